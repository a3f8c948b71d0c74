"""Checkpoints and resuming: what a checkpoint holds of a run (plain dicts of tensors and built-in types, so
``torch.load(weights_only=True)`` reads them), writing it without stalling training, and starting a run fresh or
from ``--resume`` (and the command that resumes an interrupted one)."""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
import torch.nn as nn

from models.data.folder import HOLDOUT_RULE
from models.presets import EvalPreset
from models.run.args import DataError
from models.run.optim import SchedulePlan, Scheduler, continue_schedule, schedule_plan
from models.run.report import METRICS_NAME, rerun_command

log = logging.getLogger("models.train")

CHECKPOINT_NAME = "checkpoint.pt"
BEST_NAME = "best.pt"


@dataclass(frozen=True)
class Best:
    """The best epoch so far: its validation top-1 and loss (what a later epoch must beat), its metrics row (the
    summary's) and its confusion counts (confusion.json), kept in every checkpoint so a resumed run reports it."""

    acc1: float = -1.0
    loss: float = math.inf
    row: dict[str, float] | None = None
    confusion: torch.Tensor | None = None


NO_BEST = Best()  # before the first epoch


def _finite_or_inf(loss: float) -> float:
    return loss if math.isfinite(loss) else math.inf


def better(acc1: float, loss: float, best: Best) -> bool:
    """Whether an epoch's validation beats ``best``: higher top-1, and on a tie (usual on small sets, where top-1
    moves in steps of 1/len(val)) lower loss. A loss that is not finite counts as infinite: a NaN compares false
    both ways, so an epoch of NaN loss held "best" against any later one of the same top-1."""
    return (acc1, -_finite_or_inf(loss)) > (best.acc1, -_finite_or_inf(best.loss))


def plain_args(args: argparse.Namespace) -> dict[str, Any]:
    """argparse values as built-in types (paths become absolute strings: an export run from another folder finds
    the run's data) so the checkpoint stays weights_only-safe."""
    return {key: os.path.abspath(value) if isinstance(value, Path) else value for key, value in vars(args).items()
            if not key.startswith("_")}  # (the parser's own notes: ``_given``)


def rng_state() -> dict[str, Any]:
    """The global RNG states a run draws from after start-up (dropout, stochastic depth, Python's random); on CUDA,
    the generator of the device this process trains on (the current one: torchrun's ranks each set theirs), the
    only one it draws from."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` saved; the CUDA state onto this process's own device only, whatever the number
    of GPUs it was saved on: every rank takes rank 0's, which wrote the checkpoint (seeded alike and drawing alike,
    the ranks' states are the same). An older checkpoint's list of every device's state gives the first: rank 0's."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    cuda = state.get("cuda")
    if isinstance(cuda, (list, tuple)):
        cuda = cuda[0] if cuda else None
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)


def _replace_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """``write`` a temporary file beside ``target``, then rename it over ``target``: a crash, a kill or a full
    disk mid-write leaves the previous ``target`` whole (and no temporary file, where the write raised)."""
    tmp = target.with_name(target.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_checkpoint(state: dict[str, Any], output_dir: Path, *, is_best: bool) -> Path:
    """Write ``checkpoint.pt``, and copy it to ``best.pt`` when ``is_best``, each atomically (a crash mid-write
    keeps the previous one)."""
    target = output_dir / CHECKPOINT_NAME
    _replace_atomically(target, lambda tmp: torch.save(state, tmp))
    if is_best:
        _replace_atomically(output_dir / BEST_NAME, lambda tmp: shutil.copyfile(target, tmp))
    return target


def snapshot(value: Any) -> Any:
    """A copy of a state on the CPU that training can no longer change (tensors copied, containers rebuilt)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: snapshot(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(snapshot(item) for item in value)
    return value


class CheckpointWriter:
    """Writes checkpoints on a thread, so the disk write does not stall the next epoch's steps; one at a time.

    ``save`` snapshots the state first (a copy to host memory: milliseconds), waits for the previous write, then
    hands the snapshot to a thread; ``wait`` returns when it is on disk and re-raises a failed write.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, state: dict[str, Any], output_dir: Path, *, is_best: bool) -> None:
        """Snapshot ``state`` and write it as :func:`save_checkpoint` does, in the background."""
        copy = snapshot(state)
        self.wait()
        self._thread = threading.Thread(target=self._write, args=(copy, output_dir, is_best),
                                        name="checkpoint-writer", daemon=False)
        self._thread.start()

    def _write(self, state: dict[str, Any], output_dir: Path, is_best: bool) -> None:
        try:
            save_checkpoint(state, output_dir, is_best=is_best)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread by wait()
            self._error = exc

    def wait(self) -> None:
        """Block until the last write finished; raise its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint on the CPU with the safe unpickler; FileNotFoundError when it is not there."""
    if path.is_dir():
        held = [name for name in (BEST_NAME, CHECKPOINT_NAME) if (path / name).is_file()]
        raise FileNotFoundError(f"checkpoint {path} is a folder" + (
            f": give a checkpoint in it, {' or '.join(str(path / name) for name in held)}" if held else ""))
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    return torch.load(path, map_location="cpu", weights_only=True)


def checkpoint_state(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: object,
                      scaler: torch.amp.GradScaler | None, epoch: int, best: Best, args: argparse.Namespace,
                      classes: list[str], preset: EvalPreset, metrics: dict[str, float],
                      prediction_reference: dict[str, object] | None = None) -> dict[str, object]:
    """Everything a run needs to go on, as plain types (``torch.load(weights_only=True)`` reads it); with this
    epoch's validation reference (models/run/reference.py) for the export's manifest."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "lr_scheduler": scheduler.state_dict(),  # type: ignore[attr-defined]
            "scaler": scaler.state_dict() if scaler else None, "epoch": epoch, "best_acc1": best.acc1,
            "best_val_loss": best.loss, "best_metrics": best.row, "best_confusion": best.confusion,
            "args": plain_args(args), "arch": args.arch, "classes": classes,
            "preset": preset.model_dump(), "metrics": metrics, "prediction_reference": prediction_reference,
            "holdout": holdout(args), "rng": rng_state()}


Holdout = dict[str, Any]  # the --val-split holdout a run validates on: its rule, fraction and seed (and its sides)
HOLDOUT_KEYS = ("rule", "fraction", "seed")  # what a resumed run's holdout must match (its sides are kept)


def holdout(args: argparse.Namespace) -> Holdout | None:
    """The ``--val-split`` holdout this run validates on, with its sides (the paths held out and trained on, each
    side one newline-joined string: a resumed run keeps them, ``split_holdout``); None for train/ and val/
    folders."""
    if args.val_split is None:
        return None
    rule: Holdout = {"rule": HOLDOUT_RULE, "fraction": float(args.val_split), "seed": int(args.split_seed)}
    sides = getattr(args, "_split_sides", None)
    if sides is not None:
        rule["sides"] = {"held": "\n".join(sorted(sides[0])), "trained": "\n".join(sorted(sides[1]))}
    return rule


def saved_sides(state: dict[str, Any]) -> tuple[frozenset[str], frozenset[str]] | None:
    """The (held out, trained on) paths a checkpoint's run split its folder into; None for a run of train/ and val/
    folders, or one from before they were saved."""
    sides = (state.get("holdout") or {}).get("sides")
    if not isinstance(sides, dict):
        return None
    return tuple(frozenset(filter(None, str(sides.get(side, "")).split("\n"))) for side in ("held", "trained"))


def _saved_holdout(state: dict[str, Any]) -> Holdout | None:
    """The holdout a checkpoint's run validated on; a checkpoint from before the rule was recorded held out each
    class by another rule (a seeded shuffle, which one more image reshuffled)."""
    if "holdout" in state:
        return state["holdout"]
    saved = state["args"]
    if saved.get("val_split") is None:
        return None
    return {"rule": "class-shuffle", "fraction": float(saved["val_split"]), "seed": int(saved["seed"])}


def _rule_of(split: Holdout | None) -> dict[str, Any] | None:
    """A holdout's rule, fraction and seed (not its sides)."""
    return None if split is None else {key: split[key] for key in HOLDOUT_KEYS}


def _holdout_text(split: Holdout | None) -> str:
    if split is None:
        return "its train/ and val/ folders"
    older = " by an older rule" if split["rule"] != HOLDOUT_RULE else ""
    return f"a --val-split {split['fraction']:g} holdout of --split-seed {split['seed']}{older}"


def _check_same_holdout(path: Path, state: dict[str, Any], args: argparse.Namespace) -> None:
    """DataError when the run resumed validated on other images than this one would: it would validate on images
    it trained on (and its best epoch was chosen on another set)."""
    saved, now = _saved_holdout(state), holdout(args)
    if _rule_of(saved) != _rule_of(now):
        # only the seed differs: a run from before --split-seed held out by its --seed (--seed 1: --split-seed 1)
        seed_only = saved is not None and now is not None and {**_rule_of(saved), "seed": now["seed"]} == _rule_of(now)
        options = (f"resume with --split-seed {saved['seed']}" if seed_only else
                   "leave --val-split and --split-seed out (the run's are taken)")
        raise DataError(f"{path} validated on {_holdout_text(saved)}, this run on {_holdout_text(now)}: it would "
                        f"validate on images it trained on; {options} or train afresh into another --output-dir")


# What a run is, which a resumed run takes from its checkpoint where the command line does not give it (its images
# as made, its data and holdout, its network, optimiser, rates and schedule, its seeds); where and how it runs (the
# device, workers, --compile, --tf32, the output and exports) is the command's
RUN_OPTIONS = ("data", "val_split", "split_seed", "seed", "arch", "pretrained", "weights", "freeze_backbone",
               "backbone_lr_scale", "epochs", "batch_size", "opt", "lr", "momentum", "weight_decay", "label_smoothing",
               "lr_warmup_epochs", "clip_grad_norm", "amp", "amp_dtype", "freeze_bn", "bn_recompute_batches",
               "resize_size", "crop_size", "interpolation", "mean", "std", "hflip_prob", "min_crop_scale", "name")
PATH_OPTIONS = frozenset({"data", "weights"})  # saved as absolute paths' strings (``plain_args``)


def resumed_run(args: argparse.Namespace) -> dict[str, Any] | None:
    """The preset ``--resume``'s checkpoint trained with (None without one, or from a file that is no readable
    checkpoint: ``_resume`` says so), each of its ``RUN_OPTIONS`` the command line does not give set on ``args``
    (a run at --crop-size 64 resumed without it trained on at 224, and its export was served at 224, unsaid; one
    resumed without --data, --pretrained or --opt was refused, or went on at the default --lr), said in the log;
    DataError when ``--resume`` names no file, or its run's --data was not saved and none is given."""
    path = args.resume
    if path is None:
        return None
    if path.is_dir():
        inside = path / CHECKPOINT_NAME
        raise DataError(f"--resume {path} is a folder: give the run's checkpoint" + (
            f" (--resume {inside})" if inside.is_file() else f", its {CHECKPOINT_NAME}"))
    if not path.is_file():
        raise DataError(f"--resume {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - not a checkpoint: read_resumable refuses it in words
        state = None
    saved = state.get("args") if isinstance(state, dict) else None
    if not isinstance(saved, dict):
        if args.data is None:  # nothing to go on with (an export's state dict, a file torch cannot read): said now
            read_resumable(path)
        return None
    given, taken = getattr(args, "_given", frozenset()), []
    if "arch" in given and saved.get("arch") not in (None, args.arch):  # before its options are judged (a pretrained
        # run's: "no packaged ImageNet weights for 'resnet18'", where the mistake was the network)
        raise DataError(f"{path} was trained as {saved['arch']}, not {args.arch}: leave --arch out (the run's is "
                        "taken), or train afresh into another --output-dir")
    for name in RUN_OPTIONS:
        if name in given or name not in saved or _derived(name, saved, args):
            continue
        value = Path(saved[name]) if name in PATH_OPTIONS and saved[name] is not None else saved[name]
        if getattr(args, name, None) != value:
            setattr(args, name, value)
            taken.append(_given_as(name, value))
    if args.data is None:
        raise DataError(f"{path} does not say its run's data: give it (--data DIR)")
    if "data" not in given and not args.data.exists():
        raise DataError(f"--data {args.data} (the run's, from {path}) does not exist: give --data DIR where its "
                        "images are now")
    if taken:
        log.info("resuming %s with its run's %s", path, ", ".join(taken))
    args._resumed_sides = saved_sides(state)  # its images keep their sides (models/data/loaders.splits)
    return state.get("preset") if isinstance(state.get("preset"), dict) else None


def check_resumed_preset(path: Path, saved: dict[str, Any] | None, preset: EvalPreset) -> None:
    """DataError when a resumed run would make its images otherwise than its checkpoint trained on (another
    --resize-size, --crop-size, --interpolation, --mean, --std, or --pretrained's normalisation)."""
    now = preset.model_dump()
    changed = [f"{key} {saved[key]} -> {now[key]}" for key in now
               if saved is not None and key in saved and saved[key] != now[key]]
    if changed:
        raise DataError(f"{path} trained on images made otherwise ({'; '.join(changed)}): leave --resize-size, "
                        f"--crop-size, --interpolation, --mean, --std and --pretrained out (the run's are taken), or "
                        f"train afresh into another --output-dir")


RESUMED_KEYS = ("model", "optimizer", "lr_scheduler", "epoch", "best_acc1", "args", "arch", "classes", "rng")
# Options that shape the optimiser's state: a checkpoint's state loads only into an optimiser made with the same.
STATE_OPTIONS = ("opt", "freeze_backbone")
# Options a resumed run takes as they are given now, applied to the restored optimiser's groups (the NaN error's
# advice, "lower --lr", is followed by resuming with a lower --lr).
RATE_OPTIONS = ("lr", "backbone_lr_scale", "momentum", "weight_decay")


def _derived(name: str, saved: dict[str, Any], args: argparse.Namespace) -> bool:
    """Whether the run's ``name`` is left to be made again: an --lr the run derived from its global batch (this
    run's may differ: another --batch-size, or number of processes), an --amp-dtype for a run resumed with --no-amp
    (it would do nothing)."""
    if name == "lr":
        return bool(saved.get("lr_from_batch"))
    return name == "amp_dtype" and not args.amp


def _flag(name: str) -> str:
    """An option's name as a command line writes it."""
    return "--" + name.replace("_", "-")


def _given_as(name: str, value: Any) -> str:
    """An option as a command line gives it (a flag's absence said as "no --flag")."""
    if isinstance(value, bool):
        return _flag(name) if value else f"no {_flag(name)}"
    if isinstance(value, (list, tuple)):  # (--mean R G B)
        return f"{_flag(name)} {' '.join(f'{item:g}' if isinstance(item, float) else str(item) for item in value)}"
    return f"{_flag(name)} {value}"


def _option(name: str, value: Any) -> str:
    """An option as a sentence says a run had it ("with --opt sgd", "without --freeze-backbone")."""
    if isinstance(value, bool):
        return f"{'with' if value else 'without'} {_flag(name)}"
    return f"with {_given_as(name, value)}"


def _first_line(exc: BaseException, limit: int = 100) -> str:
    """``Type: message``, its first line cut at ``limit`` characters (torch's refusals run to paragraphs)."""
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def read_run_checkpoint(path: Path, keys: tuple[str, ...], option: str, takes: str) -> dict[str, Any]:
    """The ``models.train`` checkpoint at ``path`` holding ``keys``, or DataError in one line when it is none (a file
    torch cannot read, an export's weights-only state dict), naming ``option`` and what it ``takes``;
    FileNotFoundError when it is not there."""
    try:
        state = load_checkpoint(path)
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch.load raises UnpicklingError, RuntimeError, EOFError, ...
        raise DataError(f"{path} is no checkpoint torch can read ({_first_line(exc)}): {option} takes the "
                        f"{takes} of a models.train run") from None
    missing = [key for key in keys if key not in state] if isinstance(state, dict) else list(keys)
    if missing or not isinstance(state.get("args"), dict):
        raise DataError(f"{path} is no models.train checkpoint (it lacks {', '.join(missing or ['args'])}; an "
                        f"export's model.state_dict.pt holds weights only): {option} takes a run's {takes}")
    return state


def read_resumable(path: Path) -> dict[str, Any]:
    """The checkpoint ``--resume`` names (read_run_checkpoint)."""
    return read_run_checkpoint(path, RESUMED_KEYS, "--resume", "checkpoint.pt")


def _check_same_state_options(path: Path, saved: dict[str, Any], args: argparse.Namespace) -> None:
    """DataError naming the option when the checkpoint's optimiser state cannot load into this run's optimiser
    (another --opt has other state; --freeze-backbone other parameter groups)."""
    for name in STATE_OPTIONS:
        if name in saved and saved[name] != getattr(args, name):
            then, now = _option(name, saved[name]), _option(name, getattr(args, name))
            raise DataError(f"{path} was trained {then}, this run {now}: its optimiser state cannot go on with "
                            f"another; leave {_flag(name)} out (the run's is taken), or train afresh "
                            f"into another --output-dir")


@dataclass(frozen=True)
class Resumed:
    """What a checkpoint restores beside the weights: the next epoch, the best epoch so far, the plan of its
    schedule and that schedule's state (which only a schedule of the same plan can take), its options."""

    start: int
    best: Best
    planned: SchedulePlan
    schedule: dict[str, Any]
    args: dict[str, Any]


def _resume(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None,
            args: argparse.Namespace, classes: list[str]) -> Resumed:
    """Restore a checkpoint's weights, optimiser, scaler and RNG; what does not fit this run is a DataError naming
    why, before anything is restored."""
    state = read_resumable(path)
    if state["arch"] != args.arch or state["classes"] != classes:
        raise DataError(f"{path} was trained as {state['arch']} on classes {state['classes']}, "
                        f"not {args.arch} on {classes}")
    _check_same_holdout(path, state, args)
    _check_same_state_options(path, state["args"], args)
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise DataError(f"{path} does not fit this run's model or optimiser ({_first_line(exc)}): leave the "
                        f"run's options out (they are taken from it), or train afresh into another --output-dir"
                        ) from None
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    set_rng_state(state["rng"])
    # Older checkpoints: no loss, no best epoch's figures (its summary and confusion.json are not reported).
    best = Best(float(state["best_acc1"]), float(state.get("best_val_loss", math.inf)), state.get("best_metrics"),
                state.get("best_confusion"))
    planned = schedule_plan(int(state["args"]["epochs"]), int(state["args"]["lr_warmup_epochs"]))
    return Resumed(int(state["epoch"]) + 1, best, planned, state["lr_scheduler"], state["args"])


RUN_FILES = (CHECKPOINT_NAME, BEST_NAME, METRICS_NAME)


def _same_folder(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def resumes_elsewhere(args: argparse.Namespace) -> bool:
    """Whether ``--resume`` continues a run in another ``--output-dir`` than the checkpoint's own folder."""
    return args.resume is not None and not _same_folder(args.resume.parent, args.output_dir)


def check_fresh_output(args: argparse.Namespace) -> None:
    """DataError when a run would write into an ``--output-dir`` that holds another run: a fresh run (its
    checkpoints would be replaced and its metrics.jsonl mixed with the new run's epochs: a plot then draws one curve
    of both), or a ``--resume`` into another run's folder (its best.pt, which no later epoch may beat, would be
    exported as this run's); or that cannot be a folder (a file, or under one)."""
    existing = next((p for p in (args.output_dir, *args.output_dir.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise DataError(f"--output-dir {args.output_dir} cannot be a folder: {existing} is a file")
    if args.resume and not resumes_elsewhere(args):
        return
    earlier = [name for name in RUN_FILES if (args.output_dir / name).exists()]
    if earlier and args.resume:
        raise DataError(f"{args.output_dir} holds another run ({', '.join(earlier)}): resume {args.resume} in its "
                        f"own folder (--output-dir {args.resume.parent}) or into a new --output-dir (or go on with "
                        f"the run there: --resume {args.output_dir / CHECKPOINT_NAME})")
    if earlier:
        raise DataError(f"{args.output_dir} holds an earlier run ({', '.join(earlier)}): continue it with --resume "
                        f"{args.output_dir / CHECKPOINT_NAME}, or choose another --output-dir")


def _best_source(args: argparse.Namespace, resumed: Resumed) -> Path:
    """The file holding the resumed run's best epoch, to carry into another ``--output-dir``: the checkpoint itself
    when that epoch is its own, else the best.pt beside it when that is of the same epoch; DataError when neither
    (a checkpoint copied away from its run: no later epoch may beat its best, so the export would find none)."""
    epoch = None if resumed.best.row is None else int(resumed.best.row["epoch"])
    if epoch is not None and epoch == resumed.start - 1:
        return args.resume
    beside = args.resume.parent / BEST_NAME
    if beside.is_file() and not _same_folder(beside, args.resume):
        try:
            beside_epoch = int(load_checkpoint(beside)["epoch"])
        except Exception:  # noqa: BLE001 - torn or foreign: not this run's best
            beside_epoch = None
        if beside_epoch is not None and (epoch is None or beside_epoch == epoch):
            return beside
    shown = "its best epoch" if epoch is None else f"its best epoch ({epoch + 1})"
    raise DataError(f"{args.resume.parent} holds no best.pt of {shown} to carry into --output-dir "
                    f"{args.output_dir}: resume in the checkpoint's own folder (--output-dir {args.resume.parent})")


def best_weights(args: argparse.Namespace, epoch: int) -> dict[str, torch.Tensor] | None:
    """The weights of a resumed run's best epoch ``epoch`` (not its checkpoint's own), from the best.pt beside its
    checkpoint; None where no best.pt of that epoch is there (a checkpoint copied away from its run)."""
    try:
        state = load_checkpoint(args.resume.parent / BEST_NAME)
    except Exception:  # noqa: BLE001 - gone, torn or foreign: not this run's best
        return None
    return state.get("model") if state.get("epoch") == epoch else None


def remeasured_best(path: Path, best: Best, reference: dict[str, object] | None) -> None:
    """The best.pt at ``path``, of ``best``'s epoch, given the figures that epoch was measured again with (its
    validation row, best figures and prediction reference): what the export takes from it is then of the same
    held-out images as the run's summary. Nothing where best.pt is of another epoch, or not there."""
    try:
        state = load_checkpoint(path)
    except Exception:  # noqa: BLE001 - gone, torn or foreign: nothing of this run's to mend
        return
    if best.row is None or state.get("epoch") != int(best.row["epoch"]):
        return
    state.update({"metrics": best.row, "prediction_reference": reference, "best_acc1": best.acc1,
                  "best_val_loss": best.loss, "best_metrics": best.row, "best_confusion": best.confusion})
    _replace_atomically(path, lambda tmp: torch.save(state, tmp))


def carry_run(args: argparse.Namespace, resumed: Resumed, source: Path) -> None:
    """Start the resumed run's new ``--output-dir`` as a run folder of its own: the checkpoint it resumes (what
    Ctrl-C's and a NaN's hints go on from), its best.pt (what the export takes when no later epoch beats it) and
    the metrics.jsonl rows of the epochs before the one it resumes at (its curves whole)."""
    args.output_dir.mkdir(parents=True, exist_ok=True)
    _replace_atomically(args.output_dir / CHECKPOINT_NAME, lambda tmp: shutil.copyfile(args.resume, tmp))
    _replace_atomically(args.output_dir / BEST_NAME, lambda tmp: shutil.copyfile(source, tmp))
    metrics = args.resume.parent / METRICS_NAME
    if metrics.is_file():
        rows = [line for line in metrics.read_text(encoding="utf-8").splitlines()
                if line.strip() and int(json.loads(line)["epoch"]) < resumed.start]
        (args.output_dir / METRICS_NAME).write_text("".join(row + "\n" for row in rows), encoding="utf-8")
    log.info("resuming %s into %s: its checkpoint, best.pt (from %s) and metrics.jsonl carried there",
             args.resume.parent, args.output_dir, source.name)


class Start(NamedTuple):
    """Where a run starts: the first epoch to train, the best epoch so far, the schedule, and the epochs the run
    was planned for (a resumed one's checkpoint's, else --epochs)."""

    epoch: int
    best: Best
    scheduler: Scheduler
    planned_epochs: int


def _apply_rates(optimizer: torch.optim.Optimizer, saved: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """Give the restored optimiser's groups this run's --lr (the head's; the backbone's scaled by
    --backbone-lr-scale, as make_optimizer does), --momentum and --weight-decay; returns what changed, as
    "--lr 30 -> 0.01". The learning rates are set as each group's initial rate, which the schedule then follows."""
    changed = [f"--{name.replace('_', '-')} {saved[name]:g} -> {getattr(args, name):g}" for name in RATE_OPTIONS
               if saved.get(name) is not None and float(saved[name]) != float(getattr(args, name))]
    bases = [args.lr, args.lr * args.backbone_lr_scale]  # the head's group, then the backbone's (when trained)
    for group, base in zip(optimizer.param_groups, bases):
        group["initial_lr"] = base
        group["weight_decay"] = args.weight_decay
        if "momentum" in group:  # SGD's; AdamW has betas instead
            group["momentum"] = args.momentum
    return changed


def start_or_resume(args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Scheduler, scaler: torch.amp.GradScaler | None,
                    classes: list[str], *, is_main: bool = True) -> Start:
    """The first epoch to run, the best epoch so far, the schedule and the planned epochs: fresh, or continued from
    ``--resume`` (into another ``--output-dir``: the checkpoint, its best.pt and metrics carried there first, by the
    main process, ``is_main``).

    ``scheduler`` is the schedule this run's options plan; it takes the checkpoint's schedule state only when the
    resumed run's plan and learning rates were the same (then it goes on exactly as an uninterrupted run's would)."""
    if not args.resume:
        return Start(0, NO_BEST, scheduler, args.epochs)
    resumed = _resume(args.resume, model, optimizer, scaler, args, classes)
    start, planned = resumed.start, resumed.planned
    elsewhere = resumes_elsewhere(args)
    source = _best_source(args, resumed) if elsewhere and start < args.epochs else None
    if start < args.epochs:  # (a finished run's resume says it has nothing to train, not an epoch it will not run)
        log.info("resumed from %s at epoch %d", args.resume, start + 1)
    changed = _apply_rates(optimizer, resumed.args, args)
    now = schedule_plan(args.epochs, args.lr_warmup_epochs)
    if planned == now and not changed:
        scheduler.load_state_dict(resumed.schedule)
    elif start < args.epochs:
        # Extending (or shortening) a run, or new rates: the cosine is laid over the new length from the new rates
        # and continued from this epoch, so the learning rate is what a run planned so would have now (not 0, not
        # a restart). The saved state is not loaded: its schedule's shape may differ (a 1-epoch run's is the cosine
        # alone, a longer one's a warm-up then the cosine), and the new one is rebuilt from the groups' initial
        # rates anyway.
        scheduler = continue_schedule(optimizer, args, start)
        if planned != now:
            log.info("the schedule was planned for %d epochs (%d of warm-up): stretched to %d (%d of warm-up), "
                     "learning rate now %.3g", *planned, *now, optimizer.param_groups[0]["lr"])
        if changed:
            log.info("resumed with %s: the optimiser goes on with the new values, learning rate now %.3g",
                     ", ".join(changed), optimizer.param_groups[0]["lr"])
    if source is not None and is_main:
        carry_run(args, resumed, source)
    return Start(start, resumed.best, scheduler, int(resumed.args["epochs"]))


def interrupted(args: argparse.Namespace, argv: list[str], world_size: int = 1) -> str:
    """What Ctrl-C leaves: the last checkpoint and the exact command that goes on from it (under torchrun, the
    torchrun command of ``world_size`` processes)."""
    saved = args.output_dir / CHECKPOINT_NAME
    if not saved.exists():
        return "interrupted before the first epoch ended: no checkpoint to resume from"
    kept, words = [], iter(argv)
    for word in words:  # the same options, without an earlier --resume
        if word == "--resume":
            next(words, None)  # and its value
        elif not word.startswith("--resume="):
            kept.append(word)
    command = rerun_command("models.train", [*kept, "--resume", str(saved)], world_size)
    return f"interrupted: the last finished epoch is in {saved}; to go on: {command}"
