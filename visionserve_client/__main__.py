"""``visionserve`` (pip) or ``python -m visionserve_client`` (the repository): predict, embed, health, ready and
model.

    visionserve predict cat.jpg cup.jpg --top-k 3                # a table, under the model and version that answered
    visionserve predict cat.jpg --json --url http://host:8000    # options before or after the command
    visionserve predict cat.jpg --model colour --version 2       # ask one model's version
    visionserve embed cat.jpg cup.jpg --json                     # each image's embedding (its vector in JSON)
    visionserve model --labels
Each file gets its own result or error. Exit codes: 0 success (and, for health/ready, a yes), 1 a server error
(for any file) or a no, 2 a usage error or a file that cannot be read.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from pathlib import Path
from typing import Sequence

from visionserve_client.api import Client
from visionserve_client.errors import VisionServeError
from visionserve_client.types import Embedding, Prediction


DEFAULT_URL, DEFAULT_TIMEOUT_S, DEFAULT_RETRIES = "http://127.0.0.1:8000", 30.0, 3
# The server's hints name its query parameters ("name one (?model=NAME, or /v2/models/NAME/...)"); on the command
# line they are options. The server's message is left as it is; only what the CLI prints is translated.
_URL_HINT = re.compile(r"\?model=NAME, or /v2/models/NAME/\.\.\.")
_QUERY_PARAMETER = re.compile(r"([?&])(model|version|top_k)=([A-Z]+)\b")
# "top_k (parameter) must be from 1 to 4": the server names where the value came from; here it came from --top-k.
_NAMED_PARAMETER = re.compile(r"\btop_k \((?:parameter|query|body|form)\)")


def _connection_options(parser: argparse.ArgumentParser, defaults: bool) -> None:
    # On the main parser and on each command, so they work before or after it; a command's copy has no default
    # (SUPPRESS), so it does not overwrite a value given before the command. Help texts name the defaults
    # themselves (argparse's %(default)s would read SUPPRESS on a command's copy); never the key's value.
    def default(value: object) -> object:
        return value if defaults else argparse.SUPPRESS

    url = os.environ.get("VISIONSERVE_URL")
    where = "from $VISIONSERVE_URL" if url else "or set VISIONSERVE_URL"
    parser.add_argument("--url", default=default(url or DEFAULT_URL),
                        help=f"the server (default: {url or DEFAULT_URL}, {where})")
    key_set = "set" if os.environ.get("VISIONSERVE_API_KEY") else "not set"
    parser.add_argument("--api-key", default=default(os.environ.get("VISIONSERVE_API_KEY")),
                        help=f"sent as a Bearer token (default: $VISIONSERVE_API_KEY, {key_set}; else none)")
    parser.add_argument("--timeout", type=float, default=default(DEFAULT_TIMEOUT_S),
                        help=f"seconds per HTTP call (default: {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--retries", type=int, default=default(DEFAULT_RETRIES),
                        help=f"retries on 429/503 and connection errors (default: {DEFAULT_RETRIES})")


def _predict_options(predict: argparse.ArgumentParser) -> None:
    predict.add_argument("images", nargs="+", help="image files (JPEG, PNG, WebP, BMP, GIF)")
    predict.add_argument("--top-k", type=int, default=None,
                         help="classes per image (default: the server's TOP_K, at most the model's classes)")
    predict.add_argument("--model", default=None, metavar="NAME",
                         help="the served model to ask (default: the server's default model; see `model`)")
    predict.add_argument("--version", default=None, metavar="V",
                         help="the model's version to ask (default: that model's default version)")
    predict.add_argument("--json", action="store_true", help="print JSON instead of a table (default: a table)")


def _parser() -> argparse.ArgumentParser:
    # `visionserve` when installed with pip (pyproject.toml), `python -m visionserve_client` from the repository.
    prog = "visionserve" if Path(sys.argv[0]).name == "visionserve" else "python -m visionserve_client"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _connection_options(parser, defaults=True)
    commands = parser.add_subparsers(dest="command", required=True)
    _predict_options(commands.add_parser("predict", help="classify image files"))
    embed = commands.add_parser("embed", help="image files' embeddings (the model's pooled features)")
    embed.add_argument("images", nargs="+", help="image files (JPEG, PNG, WebP, BMP, GIF)")
    embed.add_argument("--model", default=None, metavar="NAME",
                       help="the served model to ask (default: the server's default model; see `model`)")
    embed.add_argument("--version", default=None, metavar="V",
                       help="the model's version to ask (default: that model's default version)")
    embed.add_argument("--json", action="store_true",
                       help="print each vector as JSON (default: a line per image with its length and first values)")
    commands.add_parser("health", help="is the server alive?")
    commands.add_parser("ready", help="is the server ready for work?")
    model = commands.add_parser("model", help="a served model's metadata")
    model.add_argument("--labels", action="store_true", help="include the class names (default: without)")
    model.add_argument("--model", default=None, metavar="NAME", help="which (default: the server's default model)")
    for command in commands.choices.values():
        _connection_options(command, defaults=False)
    return parser


def _for_cli(error: object) -> str:
    """An error's text with the server's query-parameter hints said as this command's options."""
    text = _NAMED_PARAMETER.sub("--top-k", _URL_HINT.sub("--model NAME", str(error)))
    return _QUERY_PARAMETER.sub(lambda m: f"{' ' if m[1] == '&' else ''}--{m[2].replace('_', '-')} {m[3]}", text)


def _answered_by(prediction: Prediction | Embedding) -> str:
    return f"model {prediction.model} version {prediction.version}"


def _table(path: str, prediction: Prediction, by: bool = False) -> list[str]:
    """One image's rows; ``by``: its path line names the model and version that answered it too."""
    width = max(len(s.label) for s in prediction.top_k)
    head = f"{path}  ({_answered_by(prediction)})" if by else path
    return [head] + [f"  {rank}. {s.label:<{width}}  {s.score:7.2%}  (class {s.index})"
                     for rank, s in enumerate(prediction.top_k, start=1)]


def _tables(answered: list[tuple[str, Prediction]]) -> list[str]:
    """The answered images' rows, under one line naming the model and version that answered them all ("model NAME
    version V"), or, when they differ (a canary met by one request and not another), naming them per image."""
    by = {(p.model, p.version) for _, p in answered if p.model is not None}
    header = [_answered_by(answered[0][1])] if len(by) == 1 else []
    return header + [line for path, p in answered for line in _table(path, p, by=len(by) > 1)]


def _predict(client: Client, args: argparse.Namespace) -> int:
    """Each file's result or its own error; exit 2 when a file cannot be read, else 1 when the server refused one."""
    results = client.predict_each(list(args.images), top_k=args.top_k, model=args.model, version=args.version)
    failed = [(path, r) for path, r in zip(args.images, results) if not isinstance(r, Prediction)]
    if args.json:
        print(json.dumps([{"image": path, **dataclasses.asdict(r)} if isinstance(r, Prediction)
                          else {"image": path, "error": str(r)} for path, r in zip(args.images, results)], indent=2))
    else:
        answered = [(path, r) for path, r in zip(args.images, results) if isinstance(r, Prediction)]
        if answered:
            print("\n".join(_tables(answered)))
    for path, error in failed:
        said = f"cannot read it: {error.strerror}" if isinstance(error, OSError) and error.strerror else error
        print(f"error: {path}: {_for_cli(said)}", file=sys.stderr)
    if any(isinstance(error, OSError) for _, error in failed):
        return 2
    return 1 if failed else 0


def _embed(client: Client, args: argparse.Namespace) -> int:
    """The images' embeddings, in one request: a line each (its length and first values), or JSON with --json.
    Exit 2 when a file cannot be read, 1 when the server refused the request."""
    try:
        embeddings: list[Embedding] = client.embed(list(args.images), model=args.model, version=args.version)
    except OSError as exc:
        print(f"error: {exc.filename}: cannot read it: {exc.strerror}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([{"image": path, **dataclasses.asdict(e)} for path, e in zip(args.images, embeddings)]))
        return 0
    print(_answered_by(embeddings[0]))  # type: ignore[arg-type]
    for path, embedding in zip(args.images, embeddings):
        shown = ", ".join(f"{value:.4f}" for value in embedding.vector[:4])
        print(f"{path}  {len(embedding.vector)} values  [{shown}, ...]")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit code."""
    args = _parser().parse_args(argv)
    with Client(args.url, api_key=args.api_key, timeout=args.timeout, retries=args.retries) as client:
        try:
            if args.command == "predict":
                return _predict(client, args)
            if args.command == "embed":
                return _embed(client, args)
            if args.command == "model":
                print(json.dumps(client.model(labels=args.labels, model=args.model).raw, indent=2))
                return 0
            ok = client.health() if args.command == "health" else client.ready()
            print("yes" if ok else "no")
            return 0 if ok else 1
        except VisionServeError as exc:
            print(f"error: {_for_cli(exc)}", file=sys.stderr)
            if exc.code == "connection_error":
                print(f"no server answers at {args.url}: start one (make serve), or name it with --url or "
                      "VISIONSERVE_URL", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
