"""``visionserve`` (pip) or ``python -m visionserve_client`` (the repository): predict, embed, health, ready and
model.

    visionserve predict cat.jpg cup.jpg --top-k 3                # a table, under the model and version that answered
    visionserve --url http://host:8000 predict cat.jpg --json    # --url, --api-key, --timeout, --retries: before
                                                                 # or after the command; a command's own after it
    visionserve predict cat.jpg --model colour --version 2       # ask one model's version
    visionserve embed cat.jpg cup.jpg --json                     # each image's embedding (its vector in JSON)
    visionserve model --labels
    cat cat.jpg | visionserve predict -                          # `-`: the image from stdin
    visionserve predict photos/                                  # a folder: every file under it, sorted
Each file gets its own result or error (with --json, an "error" object: status, code, message, request_id); the
files go in as many requests as the server's limits need (predict and embed alike). Exit codes: 0 success (and, for
health/ready, a yes), 1 a server error (for any file), a no, or output cut short (what read it stopped: `| head`),
2 a usage error (a bad option, a URL without http://) or a file that cannot be read.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Sequence

from visionserve_client.api import Client, ImageInput
from visionserve_client.errors import UsageError, VisionServeError
from visionserve_client.types import Embedding, Prediction


DEFAULT_URL, DEFAULT_TIMEOUT_S, DEFAULT_RETRIES = "http://127.0.0.1:8000", 30.0, 3
# The server's hints name its query parameters ("name one (?model=NAME, or /v2/models/NAME/...)"); on the command
# line they are options. The server's message is left as it is; only what the CLI prints is translated.
_URL_HINT = re.compile(r"\?model=NAME, or /v2/models/NAME/\.\.\.")
_QUERY_PARAMETER = re.compile(r"([?&])(model|version|top_k)=([A-Z]+)\b")
# "top_k (parameter) must be from 1 to 4": the server names where the value came from; here it came from --top-k.
_NAMED_PARAMETER = re.compile(r"\btop_k \((?:parameter|query|body|form)\)")
STDIN = "-"
KEY_HINT = "give the server's key with --api-key KEY or VISIONSERVE_API_KEY"


def _seconds(text: str) -> float:
    """--timeout: a positive, finite number of seconds (argparse says what is wrong, exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _count(text: str, least: int = 0) -> int:
    """--retries: a whole number, 0 or more (``least``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be {least} or more, got {text}")
    return value


def _classes(text: str) -> int:
    """--top-k: a whole number, 1 or more (the server says its own upper bound)."""
    return _count(text, least=1)


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
    parser.add_argument("--timeout", type=_seconds, default=default(DEFAULT_TIMEOUT_S),
                        help=f"seconds per request to the server, its retries and waits included "
                             f"(default: {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--retries", type=_count, default=default(DEFAULT_RETRIES),
                        help=f"retries on 429/503 and connection failures, never after a timeout "
                             f"(default: {DEFAULT_RETRIES})")


def _predict_options(predict: argparse.ArgumentParser) -> None:
    predict.add_argument("images", nargs="+", help="image files (JPEG, PNG, WebP, BMP, GIF) or folders (every "
                       "file under one, sorted, hidden ones left out); - reads stdin")
    predict.add_argument("--top-k", type=_classes, default=None,
                         help="classes per image (default: the server's TOP_K, at most the model's classes)")
    predict.add_argument("--model", default=None, metavar="NAME",
                         help="the served model to ask (default: the server's default model; see `model`)")
    predict.add_argument("--version", default=None, metavar="V",
                         help="the model's version to ask (default: that model's default version)")
    predict.add_argument("--json", action="store_true", help="print JSON instead of a table (default: a table)")


def _parser() -> argparse.ArgumentParser:
    # `visionserve` when installed with pip (pyproject.toml), `python -m visionserve_client` from the repository.
    prog = "visionserve" if Path(sys.argv[0]).name == "visionserve" else "python -m visionserve_client"
    parser = argparse.ArgumentParser(prog=prog, description=(__doc__ or "").replace("``", ""),  # (not markup in help)
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _connection_options(parser, defaults=True)
    commands = parser.add_subparsers(dest="command", required=True)
    _predict_options(commands.add_parser("predict", help="classify image files"))
    embed = commands.add_parser("embed", help="image files' embeddings (the model's pooled features)")
    embed.add_argument("images", nargs="+", help="image files (JPEG, PNG, WebP, BMP, GIF) or folders (every "
                       "file under one, sorted, hidden ones left out); - reads stdin")
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
    """An error's text with the server's query-parameter hints said as this command's options, and a refused key
    with how this command sends one."""
    text = _NAMED_PARAMETER.sub("--top-k", _URL_HINT.sub("--model NAME", str(error)))
    text = _QUERY_PARAMETER.sub(lambda m: f"{' ' if m[1] == '&' else ''}--{m[2].replace('_', '-')} {m[3]}", text)
    return text + (f" ({KEY_HINT})" if isinstance(error, VisionServeError) and error.status == 401 else "")


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


def _shown(path: str) -> str:
    """A path as it can be printed: one of bytes that are not UTF-8 (surrogate escapes) with U+FFFD for them."""
    return os.fsencode(path).decode("utf-8", "replace")


def _expanded(paths: list[str]) -> list[str]:
    """Each folder named replaced by the files under it, sorted (hidden files and folders left out, as
    ``models.predict`` reads a folder); a folder with none stays, so its error says so."""
    expanded: list[str] = []
    for path in paths:
        files = sorted(os.path.join(folder, name) for folder, dirs, names in os.walk(path) for name in names
                       if not name.startswith(".") and not _hidden_below(path, folder)) if os.path.isdir(path) else []
        expanded += files or [path]
    return expanded


def _hidden_below(root: str, folder: str) -> bool:
    return any(part.startswith(".") for part in os.path.relpath(folder, root).split(os.sep) if part != ".")


def _inputs(paths: list[str]) -> list[ImageInput]:
    """The files to send: ``-`` is stdin's bytes (read once, however often it is named)."""
    data = sys.stdin.buffer.read() if STDIN in paths else b""
    return [data if path == STDIN else path for path in paths]


def _error_json(error: VisionServeError | OSError) -> dict[str, object]:
    """A file's error as --json prints it: the server's status, code, message and request id; or, for a file that
    cannot be read, no status and code ``unreadable_file``."""
    if isinstance(error, VisionServeError):
        return error.to_json()
    return {"status": None, "code": "unreadable_file", "message": f"cannot read it: {error.strerror or error}",
            "request_id": None}


def _predict(client: Client, args: argparse.Namespace) -> int:
    """Each file's result or its own error (a request refused as a whole: the error of each file it held and of
    those not sent); exit 2 when a file cannot be read, else 1 when the server refused one."""
    args.images = _expanded(args.images)
    results = client.predict_each(_inputs(list(args.images)), top_k=args.top_k, model=args.model,
                                  version=args.version)
    paths = [_shown(path) for path in args.images]
    if args.json:
        print(json.dumps([{"image": path, **dataclasses.asdict(r)} if isinstance(r, Prediction)
                          else {"image": path, "error": _error_json(r)} for path, r in zip(paths, results)], indent=2))
    else:
        answered = [(path, r) for path, r in zip(paths, results) if isinstance(r, Prediction)]
        if answered:
            print("\n".join(_tables(answered)))
    return _failures(args, [(path, r) for path, r in zip(paths, results) if not isinstance(r, Prediction)])


def _failures(args: argparse.Namespace, failed: list[tuple[str, VisionServeError | OSError]]) -> int:
    """Each failed file's error on stderr; the exit code: 2 when a file cannot be read, else 1 when the server
    refused one, else 0."""
    for path, error in failed:
        said = f"cannot read it: {error.strerror}" if isinstance(error, OSError) and error.strerror else error
        print(f"error: {path}: {_for_cli(said)}", file=sys.stderr)
    if any(isinstance(error, VisionServeError) and error.code == "connection_error" for _, error in failed):
        _no_server(args.url)
    if any(isinstance(error, OSError) for _, error in failed):
        return 2
    return 1 if failed else 0


def _embed(client: Client, args: argparse.Namespace) -> int:
    """Each image's embedding or its own error, in as many requests as the server's limits need (as predict): a
    line each (its length and first values), or JSON with --json; exit codes as predict's."""
    args.images = _expanded(args.images)
    results = client.embed_each(_inputs(list(args.images)), model=args.model, version=args.version)
    paths = [_shown(path) for path in args.images]
    if args.json:
        print(json.dumps([{"image": path, **dataclasses.asdict(r)} if isinstance(r, Embedding)
                          else {"image": path, "error": _error_json(r)} for path, r in zip(paths, results)]))
    else:
        answered = [(path, r) for path, r in zip(paths, results) if isinstance(r, Embedding)]
        by = {(e.model, e.version) for _, e in answered if e.model is not None}
        if answered and len(by) <= 1:
            print(_answered_by(answered[0][1]))
        for path, embedding in answered:  # answered by several versions (a canary met by one request): each says
            shown = ", ".join(f"{value:.4f}" for value in embedding.vector[:4])
            own = f"  ({_answered_by(embedding)})" if len(by) > 1 else ""
            print(f"{path}  {len(embedding.vector)} values  [{shown}, ...]{own}")
    return _failures(args, [(path, r) for path, r in zip(paths, results) if not isinstance(r, Embedding)])


def _no_server(url: str) -> None:
    print(f"no server answers at {url}: start one (make serve), or name it with --url or VISIONSERVE_URL",
          file=sys.stderr)


def _run(client: Client, args: argparse.Namespace) -> int:
    """The command's exit code; a server's refusal (of a request as a whole) printed, exit 1."""
    try:
        if args.command == "predict":
            return _predict(client, args)
        if args.command == "embed":
            return _embed(client, args)
        if args.command == "model":
            print(json.dumps(client.model(labels=args.labels, model=args.model).raw, indent=2))
            return 0
        try:
            said = client.says_yes("/healthz" if args.command == "health" else "/readyz")
        except VisionServeError as exc:
            if exc.status == 401:  # the probes are behind the key (AUTH_HEALTH_OPEN=false): no answer to the question
                print(f"error: the server refused the API key: {KEY_HINT}", file=sys.stderr)
                return 2
            raise  # not the service's health answer (another server at --url): said as any error
        print("yes" if said else "no")
        if said is None:  # not a server that says no: none answered
            _no_server(args.url)
        return 0 if said else 1
    except UsageError:
        raise
    except VisionServeError as exc:
        print(f"error: {_for_cli(exc)}", file=sys.stderr)
        if exc.code == "connection_error":
            _no_server(args.url)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        with Client(args.url, api_key=args.api_key, timeout=args.timeout, retries=args.retries) as client:
            return _run(client, args)
    except UsageError as exc:  # nothing a server said: the command line (--url, the key) is wrong
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # what reads the output stopped (``| head``): quietly, not a traceback
        _stdout_to_devnull()  # (the interpreter's flush at exit would raise it again)
        return 1


def _stdout_to_devnull() -> None:
    """Standard output pointed at /dev/null, where a closed pipe was (Python's documented way out of SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no file behind it (a test's capture): nothing to flush to
        pass


if __name__ == "__main__":
    sys.exit(main())
