"""What a checkpoint holds of a run, and starting a run fresh or from ``--resume`` (kept apart from the loop)."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
import torch.nn as nn

from models import checkpoint as ckpt
from models.folder import DataError
from models.loaders import Data
from models.optim import Scheduler, continue_schedule
from models.presets import EvalPreset

log = logging.getLogger("models.train")


def checkpoint_state(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: object,
                      scaler: torch.amp.GradScaler | None, epoch: int, best_acc1: float, args: argparse.Namespace,
                      data: Data, preset: EvalPreset, metrics: dict[str, float]) -> dict[str, object]:
    """Everything a run needs to go on, as plain types (``torch.load(weights_only=True)`` reads it)."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "lr_scheduler": scheduler.state_dict(),  # type: ignore[attr-defined]
            "scaler": scaler.state_dict() if scaler else None, "epoch": epoch, "best_acc1": best_acc1,
            "args": ckpt.plain_args(args), "arch": args.arch, "classes": data.classes,
            "preset": preset.model_dump(), "metrics": metrics, "rng": ckpt.rng_state()}


def _resume(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: object,
            scaler: torch.amp.GradScaler | None, args: argparse.Namespace,
            classes: list[str]) -> tuple[int, float, int]:
    """Restore a checkpoint; returns the next epoch, the best top-1 and the epochs its schedule was planned for."""
    state = ckpt.load_checkpoint(path)
    if state["arch"] != args.arch or state["classes"] != classes:
        raise DataError(f"{path} was trained as {state['arch']} on classes {state['classes']}, "
                        f"not {args.arch} on {classes}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["lr_scheduler"])  # type: ignore[attr-defined]
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    ckpt.set_rng_state(state["rng"])
    return int(state["epoch"]) + 1, float(state["best_acc1"]), int(state["args"]["epochs"])


def start_or_resume(args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Scheduler,
           scaler: torch.amp.GradScaler | None, classes: list[str]) -> tuple[int, float, Scheduler]:
    """The first epoch to run, the best top-1 so far and the schedule: fresh, or continued from ``--resume``."""
    if not args.resume:
        return 0, -1.0, scheduler
    start, best, planned = _resume(args.resume, model, optimizer, scheduler, scaler, args, classes)
    log.info("resumed from %s at epoch %d", args.resume, start)
    if planned != args.epochs and start < args.epochs:
        # Extending (or shortening) a run: the cosine is laid over the new length and continued from this epoch,
        # so the learning rate is what a run planned for --epochs would have now (not 0, not a restart).
        scheduler = continue_schedule(optimizer, args, start)
        log.info("the schedule was planned for %d epochs: stretched to %d, learning rate now %.3g",
                 planned, args.epochs, optimizer.param_groups[0]["lr"])
    return start, best, scheduler
