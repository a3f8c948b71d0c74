"""Where an HTTP worker's CPU goes in process mode (issue #50's HTTP budget): the process-mode app called through WSGI
in this process, one request at a time on one thread, against an engine process on the tiny model of
``bench.serving.overhead``; the CPU of that thread per request (``time.thread_time``, medians), for:

- the bare Flask app (``bench/serving/bare_app.py``, the budget's unit) and the app itself;
- the app with its exchange with the engine (``RemoteService.infer``: the send, the wait, the answer's read)
  replaced by the answer it got, the request still made and counted as sent;
- and then without the timing headers (``app/web/timing.py``), and then without the request hooks as well.

Each step's difference is what the part it leaves out costs a request here, cold caches after the wait included.
No gunicorn, no socket to a client: served, both apps cost about the same more per request (the overhead
benchmark's figures against these).

    .venv/bin/python -m bench.serving.http_side             # V2 x1 and JPEG, 5 rounds of 1,000 requests a step
    .venv/bin/python -m bench.serving.http_side --smoke     # a few requests a step (the suite runs it)
    .venv/bin/python -m bench.serving.http_side --instructions --requests 200   # instructions, not CPU time

``--instructions`` (valgrind installed: ``apt-get install valgrind``) runs this process under callgrind and counts
the instructions each step runs per request, the counting turned on around the step's requests only: a figure that
does not move with the host's speed from one minute to the next, so a change of a few percent shows in one run,
where the CPU time of two runs of the same code differs by 10-20% on the 2-core VM. It counts what runs in this
process, not the kernel's system calls or the wait for the engine (native, not under valgrind), and a memset counts
about one instruction per byte.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from bench.serving.callgrind import callgrind_command, callgrind_control, callgrind_total
from bench.serving.overhead import Form, forms
from bench.serving.tiny_work import TINY_WEIGHTS, padded_jpeg, tiny_weights
from bench.serving.request_path import wsgi_environ

ROOT = Path(__file__).resolve().parents[2]
STEPS = ("the app", "without the exchange", "and the timing headers", "and the hooks")


CALLGRIND_OUT = "VISIONSERVE_CALLGRIND_OUT"  # set in the process that valgrind runs (--instructions): its dumps' path


def _environ(form: Form, index: int) -> dict[str, object]:
    return wsgi_environ(form.bodies[index % len(form.bodies)], path=form.path, method=form.method,
                        headers=form.headers)


def _answer(app: Callable[..., Any], environ: dict[str, object], form: Form) -> None:
    """``app``'s whole answer to ``environ``; RuntimeError unless it is a 200."""
    status: list[str] = []
    chunks = app(environ, lambda s, h, e=None: status.append(s))
    b"".join(chunks)
    getattr(chunks, "close", lambda: None)()
    if not status[0].startswith("200"):
        raise RuntimeError(f"{form.name}: {status[0]}")


def instructions_per_request(app: Callable[..., Any], form: Form, requests: int) -> float:
    """Instructions this process runs per request of ``form`` (callgrind's count over the requests alone: this
    process runs under valgrind, ``--instructions``); each answered 200, else RuntimeError."""
    environs = [_environ(form, i) for i in range(requests)]
    # counted from the first step on (turning it off again would drop what callgrind translated)
    callgrind_control(os.getpid(), "--instr=on")
    gc.collect()  # every step from the same collector state: a full collection counts millions of instructions
    callgrind_control(os.getpid(), "--zero")
    for environ in environs:
        _answer(app, environ, form)
    callgrind_control(os.getpid(), "--dump")  # the counts since the zero
    return callgrind_total(Path(os.environ[CALLGRIND_OUT])) / requests


def cpu_per_request(app: Callable[..., Any], form: Form, requests: int) -> float:
    """Median microseconds of this thread's CPU per request of ``form`` (the first tenth left out); each answered
    200, else RuntimeError."""
    spent = []
    for i in range(requests):
        environ = _environ(form, i)
        started = time.thread_time_ns()
        _answer(app, environ, form)
        spent.append(time.thread_time_ns() - started)
    return statistics.median(spent[requests // 10:]) / 1000


@contextlib.contextmanager
def engine(weights: Path, control: Path) -> Iterator[None]:
    """An engine process on ``weights`` serving ``control``'s slot-0 socket, for the block."""
    sock = control / "engine-0.sock"
    process = subprocess.Popen([sys.executable, "-m", "bench.serving.engine_only", "--serve", str(ROOT), str(weights),
                                str(sock), "cpu"], cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        until = time.monotonic() + 120
        while not Path(f"{sock}.ready").exists():
            if process.poll() is not None or time.monotonic() > until:
                raise RuntimeError("the engine did not start")
            time.sleep(0.1)
        yield
    finally:
        process.kill()
        process.wait()


def measure(form_names: list[str], requests: int, rounds: int,
            per_request: Callable[[Callable[..., Any], Form, int], float] = cpu_per_request,
            ) -> dict[str, dict[str, float]]:
    """For each form: what ``per_request`` says a request of the bare app and of each of STEPS costs (microseconds
    of CPU, or instructions), the median of ``rounds`` rounds that each measure them all in turn. Its CONTROL_DIR
    and metrics' files in a folder of its own, removed at the end (each run left one in the temporary folder)."""
    with tempfile.TemporaryDirectory(prefix="visionserve-http-side-") as folder:
        return _measure_in(Path(folder), form_names, requests, rounds, per_request)


def _measure_in(control: Path, form_names: list[str], requests: int, rounds: int,
                per_request: Callable[[Callable[..., Any], Form, int], float]) -> dict[str, dict[str, float]]:
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(control)  # as under gunicorn: the metrics' files
    weights = tiny_weights(TINY_WEIGHTS)
    with engine(weights, control):
        import bench.serving.bare_app as bare
        import app.link.client as client
        import app.v1.routes as v1_routes
        import app.v2.routes as v2_routes
        from app.config import Settings
        from app.factory import create_app

        settings = Settings(weights_dir=weights, control_dir=control, engine="process", device="cpu",
                            log_level="warning", max_images=16, auto_batch_size=False, warmup=False)
        app = create_app(settings, engine="process", on_load_error=print)
        every = forms([padded_jpeg(i) for i in range(4)])
        until = time.monotonic() + 60
        while True:  # the engine reached, every worker's readiness marked
            try:
                cpu_per_request(app, every[form_names[0]], 1)
                break
            except RuntimeError:
                if time.monotonic() > until:
                    raise
                time.sleep(0.1)
        found: dict[str, dict[str, float]] = {}
        for name in form_names:
            form = every[name]
            real_infer, answered = client.RemoteService.infer, {}

            def kept(self: Any, *args: Any, **kwargs: Any) -> Any:
                answered["served"] = real_infer(self, *args, **kwargs)
                return answered["served"]

            client.RemoteService.infer = kept  # type: ignore[method-assign]
            cpu_per_request(app, form, 1)  # an answer of this form to give back without the exchange
            client.RemoteService.infer = real_infer  # type: ignore[method-assign]
            annotate = v1_routes.annotate, v2_routes.annotate
            hooks = dict(app.before_request_funcs), dict(app.after_request_funcs)

            def leave_out(step: int) -> None:  # the parts STEPS[step] leaves out, those of the steps before too
                if step >= 1:  # the request made and counted as sent, its answer given back as the engine's
                    client.RemoteService.infer = lambda self, *a, **k: answered["served"]  # type: ignore
                if step >= 2:
                    v1_routes.annotate = v2_routes.annotate = lambda response, served: response  # type: ignore
                if step >= 3:
                    app.before_request_funcs.clear()
                    app.after_request_funcs.clear()

            def restore() -> None:
                client.RemoteService.infer = real_infer  # type: ignore[method-assign]
                v1_routes.annotate, v2_routes.annotate = annotate
                app.before_request_funcs.update(hooks[0])
                app.after_request_funcs.update(hooks[1])

            spent: dict[str, list[float]] = {"bare app": [], **{step: [] for step in STEPS}}
            for _ in range(rounds):  # the steps alternate: this VM's speed moves from one minute to the next
                spent["bare app"].append(per_request(bare.app, every["jpeg"], requests))
                for index, step in enumerate(STEPS):
                    try:
                        leave_out(index)
                        spent[step].append(per_request(app, form, requests))
                    finally:
                        restore()
            found[name] = {step: statistics.median(values) for step, values in spent.items()}
        return found


def report(found: dict[str, dict[str, float]], requests: int, rounds: int, instructions: bool = False) -> str:
    """The Markdown table: per form, each step's CPU (or instructions) per request and what it saved against the
    step before."""
    what, unit = ("Instructions", "instructions") if instructions else ("HTTP worker CPU", "us")
    lines = [f"{what} per request in process, {requests} requests a step, medians of {rounds} rounds ({unit}); the "
             "bare app with the same JPEG body is the unit", "",
             f"| form | step | {unit} / request | in bare-app requests | saved |", "| --- | --- | --- | --- | --- |"]
    for name, row in found.items():
        before = None
        for step, us in row.items():
            saved = "" if before is None or step == STEPS[0] else f"{before - us:.0f}"
            lines.append(f"| {name} | {step} | {us:.0f} | {us / row['bare app']:.2f} | {saved} |")
            before = us
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forms", nargs="+", default=["v2 x1", "jpeg"],
                        choices=["v2 x1", "v2 x16", "jpeg", "multipart x1"])
    parser.add_argument("--requests", type=int, default=1000, help="requests a step in each round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every step in turn (medians)")
    parser.add_argument("--smoke", action="store_true", help="a few requests a step, one round")
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions under callgrind (valgrind) instead of CPU time; one round")
    args = parser.parse_args(argv)
    requests, rounds = (20, 1) if args.smoke else (args.requests, 1 if args.instructions else args.rounds)
    if args.instructions and CALLGRIND_OUT not in os.environ:  # this process again, under valgrind
        tiny_weights(TINY_WEIGHTS)  # written here: torch is not imported under valgrind, where it takes half a minute
        with tempfile.TemporaryDirectory(prefix="visionserve-callgrind-") as folder:
            out = Path(folder) / "callgrind.out"
            again = [sys.executable, "-m", "bench.serving.http_side", *(argv if argv is not None else sys.argv[1:])]
            env = {**os.environ, CALLGRIND_OUT: str(out)}
            return subprocess.run([*callgrind_command(out), *again], cwd=ROOT, env=env,
                                  stderr=subprocess.DEVNULL).returncode
    per_request = instructions_per_request if args.instructions else cpu_per_request
    print(report(measure(args.forms, requests, rounds, per_request), requests, rounds, args.instructions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
