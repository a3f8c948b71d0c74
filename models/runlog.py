"""What a run leaves behind for people: one JSON line per epoch, TensorBoard scalars when it is installed."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

METRICS_NAME = "metrics.jsonl"


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
                if key != "epoch":
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
