"""``python -m bench.serving.faults`` (or ``make faults``): the fault matrix of harness/faults.py against the real
server, printed as the table docs/deployment.md quotes."""
from __future__ import annotations

from pathlib import Path

from bench.paths import WORK
from harness.faults import HEADER, choosy_weights, matrix, small_weights
from harness.servers import Running, visionserve


def main() -> None:
    work = WORK / "faults"
    work.mkdir(parents=True, exist_ok=True)

    def start(weights: Path, **settings: str) -> Running:
        defaults = {"auto_batch_size": "false", "log_level": "info"}
        return visionserve(weights, work, **(defaults | settings))

    rows = matrix(start, small_weights(work / "small"), choosy_weights(work / "choosy"))
    print(HEADER)
    for row in rows:
        print(row.line())


if __name__ == "__main__":
    main()
