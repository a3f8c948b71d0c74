"""Checkpoints: plain dicts of tensors and built-in types, so ``torch.load(weights_only=True)`` reads them."""
from __future__ import annotations

import argparse
import random
import shutil
import threading
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_NAME = "checkpoint.pt"
BEST_NAME = "best.pt"


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
