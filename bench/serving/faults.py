"""``python -m bench.serving.faults`` (or ``make faults``): the fault matrix of harness/faults.py against the real
server, printed as the table docs/deployment.md quotes.

    .venv/bin/python -m bench.serving.faults                                  # the defaults (inline on a CPU host)
    .venv/bin/python -m bench.serving.faults --engine process --engines-per-device 2   # a GPU host's layout
"""
from __future__ import annotations

import argparse
from pathlib import Path

from bench.paths import WORK
from harness.faults import HEADER, choosy_weights, matrix, small_weights
from harness.servers import Running, visionserve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["inline", "process"], help="ENGINE (default: the server's own choice)")
    parser.add_argument("--engines-per-device", type=int, help="ENGINES_PER_DEVICE (with --engine process)")
    args = parser.parse_args(argv)
    layout = {"engine": args.engine} if args.engine else {}
    if args.engines_per_device:
        layout["engines_per_device"] = str(args.engines_per_device)
    work = WORK / "faults"
    work.mkdir(parents=True, exist_ok=True)

    def start(weights: Path, **settings: str) -> Running:
        defaults = {"auto_batch_size": "false", "log_level": "info"}
        return visionserve(weights, work, **(defaults | layout | settings))

    rows = matrix(start, small_weights(work / "small"), choosy_weights(work / "choosy"))
    if layout:
        print("Settings: " + ", ".join(f"{key.upper()}={value}" for key, value in layout.items()) + "\n")
    print(HEADER)
    for row in rows:
        print(row.line())


if __name__ == "__main__":
    main()
