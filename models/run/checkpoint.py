"""Checkpoints and resuming: what a checkpoint holds of a run (plain dicts of tensors and built-in types, so
``torch.load(weights_only=True)`` reads them), writing it without stalling training, and starting a run fresh or
from ``--resume`` (and the command that resumes an interrupted one)."""
from __future__ import annotations

import argparse
import logging
import math
import random
import shutil
import threading
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from models.presets import EvalPreset
from models.run.args import DataError
from models.run.optim import Scheduler, continue_schedule
from models.run.report import METRICS_NAME, module_command

log = logging.getLogger("models.train")

CHECKPOINT_NAME = "checkpoint.pt"
BEST_NAME = "best.pt"

Best = tuple[float, float]  # the best epoch's validation (top-1, loss)
NO_BEST: Best = (-1.0, math.inf)


def better(acc1: float, loss: float, best: Best) -> bool:
    """Whether an epoch's validation beats ``best``: higher top-1, and on a tie (usual on small sets, where top-1
    moves in steps of 1/len(val)) lower loss."""
    return (acc1, -loss) > (best[0], -best[1])


def plain_args(args: argparse.Namespace) -> dict[str, Any]:
    """argparse values as built-in types (paths become strings) so the checkpoint stays weights_only-safe."""
    return {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}


def rng_state() -> dict[str, Any]:
    """The global RNG states a run draws from after start-up (dropout, stochastic depth, Python's random)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` saved."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(state: dict[str, Any], output_dir: Path, *, is_best: bool) -> Path:
    """Write ``checkpoint.pt`` atomically (a crash mid-write keeps the previous one); copy it to ``best.pt``."""
    target = output_dir / CHECKPOINT_NAME
    tmp = target.with_suffix(".pt.tmp")
    torch.save(state, tmp)
    tmp.replace(target)
    if is_best:
        shutil.copyfile(target, output_dir / BEST_NAME)
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
            "scaler": scaler.state_dict() if scaler else None, "epoch": epoch, "best_acc1": best[0],
            "best_val_loss": best[1],
            "args": plain_args(args), "arch": args.arch, "classes": classes,
            "preset": preset.model_dump(), "metrics": metrics, "prediction_reference": prediction_reference,
            "rng": rng_state()}


def _resume(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: object,
            scaler: torch.amp.GradScaler | None, args: argparse.Namespace,
            classes: list[str]) -> tuple[int, Best, int]:
    """Restore a checkpoint; returns the next epoch, the best epoch's (top-1, loss) and the epochs its schedule was
    planned for."""
    state = load_checkpoint(path)
    if state["arch"] != args.arch or state["classes"] != classes:
        raise DataError(f"{path} was trained as {state['arch']} on classes {state['classes']}, "
                        f"not {args.arch} on {classes}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["lr_scheduler"])  # type: ignore[attr-defined]
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    set_rng_state(state["rng"])
    best = (float(state["best_acc1"]), float(state.get("best_val_loss", math.inf)))  # older checkpoints: no loss
    return int(state["epoch"]) + 1, best, int(state["args"]["epochs"])


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


def start_or_resume(args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Scheduler,
           scaler: torch.amp.GradScaler | None, classes: list[str]) -> tuple[int, Best, Scheduler]:
    """The first epoch to run, the best (top-1, loss) so far and the schedule: fresh, or continued from
    ``--resume``."""
    if not args.resume:
        return 0, NO_BEST, scheduler
    start, best, planned = _resume(args.resume, model, optimizer, scheduler, scaler, args, classes)
    log.info("resumed from %s at epoch %d", args.resume, start + 1)
    if planned != args.epochs and start < args.epochs:
        # Extending (or shortening) a run: the cosine is laid over the new length and continued from this epoch,
        # so the learning rate is what a run planned for --epochs would have now (not 0, not a restart).
        scheduler = continue_schedule(optimizer, args, start)
        log.info("the schedule was planned for %d epochs: stretched to %d, learning rate now %.3g",
                 planned, args.epochs, optimizer.param_groups[0]["lr"])
    return start, best, scheduler


def interrupted(args: argparse.Namespace, argv: list[str]) -> str:
    """What Ctrl-C leaves: the last checkpoint and the exact command that goes on from it."""
    saved = args.output_dir / CHECKPOINT_NAME
    if not saved.exists():
        return "interrupted before the first epoch ended: no checkpoint to resume from"
    kept, words = [], iter(argv)
    for word in words:  # the same options, without an earlier --resume
        if word == "--resume":
            next(words, None)  # and its value
        elif not word.startswith("--resume="):
            kept.append(word)
    command = module_command("models.train", [*kept, "--resume", str(saved)])
    return f"interrupted: the last finished epoch is in {saved}; to go on: {command}"
