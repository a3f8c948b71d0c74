"""``python -m client``: predict, health, ready and model from the command line.

    python -m client predict cat.jpg cup.jpg --top-k 3          # a readable table
    python -m client predict cat.jpg --json --url http://host:8000   # options before or after the command
    python -m client model --labels
Each file gets its own result or error. Exit codes: 0 success (and, for health/ready, a yes), 1 a server error
(for any file) or a no, 2 a usage error or a file that cannot be read.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Sequence

from client.api import Client
from client.errors import VisionServeError
from client.types import Prediction


def _connection_options(parser: argparse.ArgumentParser, defaults: bool) -> None:
    # On the main parser and on each command, so they work before or after it; a command's copy has no default
    # (SUPPRESS), so it does not overwrite a value given before the command.
    def default(value: object) -> object:
        return value if defaults else argparse.SUPPRESS

    parser.add_argument("--url", default=default(os.environ.get("VISIONSERVE_URL", "http://127.0.0.1:8000")),
                        help="the server (or set VISIONSERVE_URL)")
    parser.add_argument("--api-key", default=default(os.environ.get("VISIONSERVE_API_KEY")),
                        help="or set VISIONSERVE_API_KEY")
    parser.add_argument("--timeout", type=float, default=default(30.0), help="seconds per HTTP call")
    parser.add_argument("--retries", type=int, default=default(3), help="retries on 429/503 and connection errors")


def _parser() -> argparse.ArgumentParser:
    # `visionserve` when installed with pip (pyproject.toml), `python -m client` from the repository.
    prog = "visionserve" if Path(sys.argv[0]).name == "visionserve" else "python -m client"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _connection_options(parser, defaults=True)
    commands = parser.add_subparsers(dest="command", required=True)
    predict = commands.add_parser("predict", help="classify image files")
    predict.add_argument("images", nargs="+", help="image files (JPEG, PNG, WebP, BMP, GIF)")
    predict.add_argument("--top-k", type=int, default=None, help="classes per image (default: the server's)")
    predict.add_argument("--json", action="store_true", help="print JSON instead of a table")
    commands.add_parser("health", help="is the server alive?")
    commands.add_parser("ready", help="is the server ready for work?")
    model = commands.add_parser("model", help="the served model")
    model.add_argument("--labels", action="store_true", help="include the class names")
    for command in commands.choices.values():
        _connection_options(command, defaults=False)
    return parser


def _table(path: str, prediction: Prediction) -> list[str]:
    width = max(len(s.label) for s in prediction.top_k)
    return [path] + [f"  {rank}. {s.label:<{width}}  {s.score:7.2%}  (class {s.index})"
                     for rank, s in enumerate(prediction.top_k, start=1)]


def _predict(client: Client, args: argparse.Namespace) -> int:
    """Each file's result or its own error; exit 2 when a file cannot be read, else 1 when the server refused one."""
    results = client.predict_each(list(args.images), top_k=args.top_k)
    failed = [(path, r) for path, r in zip(args.images, results) if not isinstance(r, Prediction)]
    if args.json:
        print(json.dumps([{"image": path, **dataclasses.asdict(r)} if isinstance(r, Prediction)
                          else {"image": path, "error": str(r)} for path, r in zip(args.images, results)], indent=2))
    else:
        lines = [line for path, r in zip(args.images, results) if isinstance(r, Prediction)
                 for line in _table(path, r)]
        if lines:
            print("\n".join(lines))
    for path, error in failed:
        print(f"error: {path}: {error}", file=sys.stderr)
    if any(isinstance(error, OSError) for _, error in failed):
        return 2
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit code."""
    args = _parser().parse_args(argv)
    with Client(args.url, api_key=args.api_key, timeout=args.timeout, retries=args.retries) as client:
        try:
            if args.command == "predict":
                return _predict(client, args)
            if args.command == "model":
                print(json.dumps(client.model(labels=args.labels).raw, indent=2))
                return 0
            ok = client.health() if args.command == "health" else client.ready()
            print("yes" if ok else "no")
            return 0 if ok else 1
        except VisionServeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
