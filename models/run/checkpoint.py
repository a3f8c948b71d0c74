"""Checkpoints and resuming: what a checkpoint holds of a run (plain dicts of tensors and built-in types, so
``torch.load(weights_only=True)`` reads them), writing it without stalling training, and starting a run fresh or
from ``--resume`` (and the command that resumes an interrupted one)."""
from __future__ import annotations

import argparse
import logging
import math
import os
import random
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

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


def better(acc1: float, loss: float, best: Best) -> bool:
    """Whether an epoch's validation beats ``best``: higher top-1, and on a tie (usual on small sets, where top-1
    moves in steps of 1/len(val)) lower loss."""
    return (acc1, -loss) > (best.acc1, -best.loss)


def plain_args(args: argparse.Namespace) -> dict[str, Any]:
    """argparse values as built-in types (paths become strings) so the checkpoint stays weights_only-safe."""
    return {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}


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


Holdout = dict[str, Any]  # the --val-split holdout a run validates on: its rule, fraction and seed


def holdout(args: argparse.Namespace) -> Holdout | None:
    """The ``--val-split`` holdout this run validates on; None for train/ and val/ folders."""
    if args.val_split is None:
        return None
    return {"rule": HOLDOUT_RULE, "fraction": float(args.val_split), "seed": int(args.seed)}


def _saved_holdout(state: dict[str, Any]) -> Holdout | None:
    """The holdout a checkpoint's run validated on; a checkpoint from before the rule was recorded held out each
    class by another rule (a seeded shuffle, which one more image reshuffled)."""
    if "holdout" in state:
        return state["holdout"]
    saved = state["args"]
    if saved.get("val_split") is None:
        return None
    return {"rule": "class-shuffle", "fraction": float(saved["val_split"]), "seed": int(saved["seed"])}


def _holdout_text(split: Holdout | None) -> str:
    if split is None:
        return "its train/ and val/ folders"
    older = " by an older rule" if split["rule"] != HOLDOUT_RULE else ""
    return f"a --val-split {split['fraction']:g} holdout of seed {split['seed']}{older}"


def _check_same_holdout(path: Path, state: dict[str, Any], args: argparse.Namespace) -> None:
    """DataError when the run resumed validated on other images than this one would: it would validate on images
    it trained on (and its best epoch was chosen on another set)."""
    saved, now = _saved_holdout(state), holdout(args)
    if saved != now:
        raise DataError(f"{path} validated on {_holdout_text(saved)}, this run on {_holdout_text(now)}: it would "
                        f"validate on images it trained on; resume with the same options or train afresh into "
                        f"another --output-dir")


def _resume(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None,
            args: argparse.Namespace, classes: list[str]) -> tuple[int, Best, SchedulePlan, dict[str, Any]]:
    """Restore a checkpoint's weights, optimiser, scaler and RNG; returns the next epoch, the best epoch so far, the
    plan of its schedule and that schedule's state (which only a schedule of the same plan can take)."""
    state = load_checkpoint(path)
    if state["arch"] != args.arch or state["classes"] != classes:
        raise DataError(f"{path} was trained as {state['arch']} on classes {state['classes']}, "
                        f"not {args.arch} on {classes}")
    _check_same_holdout(path, state, args)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    set_rng_state(state["rng"])
    # Older checkpoints: no loss, no best epoch's figures (its summary and confusion.json are not reported).
    best = Best(float(state["best_acc1"]), float(state.get("best_val_loss", math.inf)), state.get("best_metrics"),
                state.get("best_confusion"))
    planned = schedule_plan(int(state["args"]["epochs"]), int(state["args"]["lr_warmup_epochs"]))
    return int(state["epoch"]) + 1, best, planned, state["lr_scheduler"]


def check_fresh_output(args: argparse.Namespace) -> None:
    """DataError when a run that does not ``--resume`` would write into an ``--output-dir`` that holds an earlier
    run: its checkpoints would be replaced and its metrics.jsonl mixed with the new run's epochs (a plot then draws
    one curve of both)."""
    if args.resume:
        return
    earlier = [name for name in (CHECKPOINT_NAME, BEST_NAME, METRICS_NAME) if (args.output_dir / name).exists()]
    if earlier:
        raise DataError(f"{args.output_dir} holds an earlier run ({', '.join(earlier)}): continue it with --resume "
                        f"{args.output_dir / CHECKPOINT_NAME}, or choose another --output-dir")


def start_or_resume(args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Scheduler, scaler: torch.amp.GradScaler | None,
                    classes: list[str]) -> tuple[int, Best, Scheduler]:
    """The first epoch to run, the best epoch so far and the schedule: fresh, or continued from ``--resume``.

    ``scheduler`` is the schedule this run's options plan; it takes the checkpoint's schedule state only when the
    resumed run's plan was the same (then it goes on exactly as an uninterrupted run's would)."""
    if not args.resume:
        return 0, NO_BEST, scheduler
    start, best, planned, saved_schedule = _resume(args.resume, model, optimizer, scaler, args, classes)
    log.info("resumed from %s at epoch %d", args.resume, start + 1)
    now = schedule_plan(args.epochs, args.lr_warmup_epochs)
    if planned == now:
        scheduler.load_state_dict(saved_schedule)
    elif start < args.epochs:
        # Extending (or shortening) a run: the cosine is laid over the new length and continued from this epoch,
        # so the learning rate is what a run planned for --epochs would have now (not 0, not a restart). The saved
        # state is not loaded: its schedule's shape may differ (a 1-epoch run's is the cosine alone, a longer one's
        # a warm-up then the cosine), and the new one is rebuilt from the optimiser's initial rates anyway.
        scheduler = continue_schedule(optimizer, args, start)
        log.info("the schedule was planned for %d epochs (%d of warm-up): stretched to %d (%d of warm-up), "
                 "learning rate now %.3g", *planned, *now, optimizer.param_groups[0]["lr"])
    return start, best, scheduler


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
