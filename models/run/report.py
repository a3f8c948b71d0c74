"""What a run reports each epoch: a line for the person watching (time, a best mark, the ETA) and a summary with
what to run next; one JSON line per epoch in ``metrics.jsonl``, and TensorBoard scalars when it is installed."""
from __future__ import annotations

import json
import logging
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.commands import command_path, module_command, python_command
from models.export.manifest import TOP5_MIN_CLASSES

log = logging.getLogger(__name__)

METRICS_NAME = "metrics.jsonl"


def duration(seconds: float) -> str:
    """``1h02m``, ``3m05s`` or ``42s``."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def rerun_command(module: str, argv: list[str], world_size: int = 1) -> str:
    """The command that runs ``python -m module argv`` again as this process was started: alone, or under torchrun
    with the same number of processes on this machine (the ``torchrun`` beside this interpreter, else ``<this
    python> -m torch.distributed.run``); a job across machines says to start the same torchrun command on each
    (their rendezvous options are not this process's to know)."""
    if world_size <= 1:
        return module_command(module, argv)
    beside = Path(sys.executable).with_name("torchrun")
    torchrun = command_path(beside) if beside.exists() else f"{python_command()} -m torch.distributed.run"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if local != world_size:
        return f"the same torchrun command on every machine (-m {module} {shlex.join(argv)})"
    return f"{torchrun} --standalone --nproc_per_node={world_size} -m {module} {shlex.join(argv)}"


HELD_OUT_NAME = "held_out.txt"  # a run that split one folder: the images it validated on, as a file list


def write_held_out(output_dir: Path, files: list[Path]) -> Path:
    """The images a run held out of its folder for validation, one a line, relative to ``output_dir`` (a file list
    models.predict reads as ``--data``, with ``--labels`` the folder: its evaluation on them alone)."""
    path = output_dir / HELD_OUT_NAME
    lines = [Path(os.path.relpath(os.path.abspath(file), os.path.abspath(output_dir))).as_posix() for file in files]
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return path


def process_started() -> float:
    """``time.perf_counter()`` at this process's start, so a command's whole time counts the interpreter's start and
    its imports (seconds on a busy machine): Linux's /proc; elsewhere, now."""
    try:
        with open("/proc/self/stat", encoding="ascii") as handle:
            start_ticks = int(handle.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, in clock ticks
        with open("/proc/uptime", encoding="ascii") as handle:
            age = float(handle.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.perf_counter()
    return time.perf_counter() - max(age, 0.0)


@dataclass
class Progress:
    """Epoch lines with time, a best mark and the run's ETA; the summary at the end."""

    epochs: int
    num_classes: int
    epoch_seconds: list[float] = field(default_factory=list)

    def line(self, row: dict[str, float], is_best: bool, seconds: float) -> str:
        self.epoch_seconds.append(seconds)
        remaining = self.epochs - 1 - int(row["epoch"])
        eta = sum(self.epoch_seconds) / len(self.epoch_seconds) * remaining
        top5 = f" top-5 {row['val_acc5']:.4f}" if self.num_classes >= TOP5_MIN_CLASSES else ""
        return (f"epoch {int(row['epoch']) + 1}/{self.epochs}: train loss {row['train_loss']:.4f} "
                f"top-1 {row['train_acc1']:.4f} | val loss {row['val_loss']:.4f} top-1 {row['val_acc1']:.4f}{top5}"
                f" | {duration(seconds)}, {row['images_per_s']:.0f} img/s{_peak(row)}{'  * best' if is_best else ''}"
                + (f" | ETA {duration(eta)}" if remaining else ""))

    def summary(self, best: dict[str, float] | None, best_checkpoint: Path, exported: Path | None,
                served: Path | None, name: str, total_seconds: float | None = None,
                validated_on: tuple[Path, Path] | None = None) -> list[str]:
        """The best epoch (``best``: its metrics row; none: no summary) and the time (this process's epochs', and
        ``total_seconds``: the whole command's, loading and the export included), then what serves this run:
        ``served`` (the export's folder or its repository) when it was exported into ``exported``, else the export
        command (model ``name``) into the run's own folder and what serves that; with ``validated_on`` (the
        ``--data`` and ``--labels`` of the images it validated on), the evaluation of the export on them."""
        if not best:
            return []
        epochs = len(self.epoch_seconds)
        took = f"{epochs} epoch{'s' if epochs != 1 else ''} in {duration(sum(self.epoch_seconds))}"
        if total_seconds is not None:
            took += f", {duration(total_seconds)} in all" + (" with the export" if exported is not None else "")
        lines = [f"done: best epoch {int(best['epoch']) + 1}, val top-1 {best['val_acc1']:.4f} "
                 f"(loss {best['val_loss']:.4f}); {took}"]
        if exported is None or served is None:
            served = best_checkpoint.parent / "export"
            named = [] if name == best_checkpoint.parent.name else ["--name", name]  # the export's default: the run's
            # the run's own export of an earlier best (a resumed run's): replaced, as the export would refuse
            replaced = ["--force"] if _holds_own_export(served, best_checkpoint.parent.name, name) else []
            lines.append("export: " + module_command("models.export", ["--checkpoint", str(best_checkpoint),
                                                                      "--out", str(served), *named, *replaced]))
        else:
            lines.append(f"exported: {exported}")
        if validated_on is not None:  # the export itself (in a repository too: its version's folder)
            data, labels = validated_on
            lines.append("evaluate: " + module_command("models.predict", [
                "--weights", str(exported or served), "--data", str(data), "--labels", str(labels),
                "--out", str(fresh_evaluation(best_checkpoint.parent))]))
        return [*lines, f"serve:  VISIONSERVE_WEIGHTS_DIR={shlex.quote(str(served))} make serve"]


EVALUATION_NAME = "eval"  # the run's evaluation by its printed command: eval.jsonl, then eval-2.jsonl, ...


def fresh_evaluation(run_dir: Path) -> Path:
    """Where the printed evaluation of ``run_dir``'s export writes: eval.jsonl, or where an earlier one is there
    (with its ``.parts`` or ``-report`` beside it: models.predict's), the first of eval-2.jsonl, eval-3.jsonl, ...
    not taken. A resumed run's export is another version, which an earlier evaluation's file would refuse to take
    (it holds one version's answers); that file is the earlier version's, kept."""
    def taken(stem: str) -> bool:
        return any((run_dir / name).exists() for name in (f"{stem}.jsonl", f"{stem}.jsonl.parts", f"{stem}-report"))

    stem, number = EVALUATION_NAME, 1
    while taken(stem):
        number += 1
        stem = f"{EVALUATION_NAME}-{number}"
    return run_dir / f"{stem}.jsonl"


RUN_SOURCE = "models.train checkpoint"  # how the manifest of a run's export begins its source (run_export_source)


def run_export_source(checkpoint_name: str, run_name: str, epoch: int | None) -> str:
    """The source an export of a run's checkpoint names in its manifest (``_holds_own_export`` reads it), its epoch
    counted from 1: "models.train checkpoint best.pt of run mine, epoch 3"."""
    return f"{RUN_SOURCE} {checkpoint_name} of run {run_name}" + ("" if epoch is None else f", epoch {epoch}")


def _holds_own_export(folder: Path, run_name: str, name: str) -> bool:
    """Whether ``folder`` holds an export of run ``run_name`` as model ``name`` (one written there by hand, of
    another run or model, is not replaced: the printed export refuses it)."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
        source = str(manifest.get("source", ""))
    except (OSError, ValueError, AttributeError):
        return False
    ran = source.startswith(f"{RUN_SOURCE} ") and f" of run {run_name}," in f"{source},"  # any checkpoint, epoch
    return ran and manifest.get("name") == name


def _peak(row: dict[str, float]) -> str:
    peak = row.get("peak_gpu_memory_mb")
    return f", peak GPU memory {peak / 1024:.2f} GiB" if peak is not None else ""


class Timer:
    """Seconds since the last ``lap``."""

    def __init__(self) -> None:
        self._last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        return seconds


class RunLog:
    """Appends epoch metrics to ``metrics.jsonl`` (and TensorBoard). Disabled on every rank but 0."""

    def __init__(self, output_dir: Path, *, enabled: bool) -> None:
        self.path = output_dir / METRICS_NAME
        self.enabled = enabled
        self._writer: Any = None
        if enabled:
            self._writer = _tensorboard_writer(output_dir / "tensorboard")

    def epoch(self, row: dict[str, float | int]) -> None:
        """Record one epoch; a resumed run appends to the same file."""
        if not self.enabled:
            return
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")
        if self._writer is not None:
            step = int(row["epoch"])
            for key, value in row.items():
                if key != "epoch" and value is not None:  # val_acc5 below 6 classes
                    self._writer.add_scalar(key, value, step)
            self._writer.flush()

    def close(self) -> None:
        """Flush and close TensorBoard's writer."""
        if self._writer is not None:
            self._writer.close()


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    """The rows of a run's metrics file, the last row winning for an epoch that was run twice (a resume)."""
    by_epoch: dict[int, dict[str, float]] = {}
    for line in (run_dir / METRICS_NAME).read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            by_epoch[int(row["epoch"])] = row
    return [by_epoch[epoch] for epoch in sorted(by_epoch)]


def _tensorboard_writer(log_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.info("tensorboard is not installed; metrics go to %s only", METRICS_NAME)
        return None
    return SummaryWriter(log_dir=str(log_dir))
