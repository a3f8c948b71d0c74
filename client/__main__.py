"""``python -m client``: predict, health, ready and model from the command line.

    python -m client predict cat.jpg cup.jpg --top-k 3          # a readable table
    python -m client predict cat.jpg --json                     # the predictions as JSON
    python -m client model --labels
Exit codes: 0 success (and, for health/ready, a yes), 1 a server error or a no, 2 a usage error.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Sequence

from client.api import Client
from client.errors import VisionServeError
from client.types import Prediction


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m client", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("VISIONSERVE_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--api-key", default=os.environ.get("VISIONSERVE_API_KEY"),
                        help="or set VISIONSERVE_API_KEY")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per HTTP call")
    parser.add_argument("--retries", type=int, default=3, help="retries on 429/503 and connection errors")
    commands = parser.add_subparsers(dest="command", required=True)
    predict = commands.add_parser("predict", help="classify image files")
    predict.add_argument("images", nargs="+", help="image files (JPEG, PNG, WebP, BMP, GIF)")
    predict.add_argument("--top-k", type=int, default=5)
    predict.add_argument("--json", action="store_true", help="print JSON instead of a table")
    commands.add_parser("health", help="is the server alive?")
    commands.add_parser("ready", help="is the server ready for work?")
    model = commands.add_parser("model", help="the served model")
    model.add_argument("--labels", action="store_true", help="include the class names")
    return parser


def _table(paths: Sequence[str], predictions: Sequence[Prediction]) -> str:
    width = max(len(s.label) for p in predictions for s in p.top_k)
    lines = []
    for path, prediction in zip(paths, predictions):
        lines.append(path)
        lines += [f"  {rank}. {s.label:<{width}}  {s.score:7.2%}  (class {s.index})"
                  for rank, s in enumerate(prediction.top_k, start=1)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit code."""
    args = _parser().parse_args(argv)
    with Client(args.url, api_key=args.api_key, timeout=args.timeout, retries=args.retries) as client:
        try:
            if args.command == "predict":
                predictions = client.predict(list(args.images), top_k=args.top_k)
                print(json.dumps([{"image": path, **dataclasses.asdict(p)} for path, p in
                                  zip(args.images, predictions)], indent=2) if args.json
                      else _table(args.images, predictions))
            elif args.command == "model":
                print(json.dumps(client.model(labels=args.labels).raw, indent=2))
            else:
                ok = client.health() if args.command == "health" else client.ready()
                print("yes" if ok else "no")
                return 0 if ok else 1
        except OSError as exc:  # an image file that cannot be read
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except VisionServeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
