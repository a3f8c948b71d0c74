"""Start and stop servers as subprocesses on free loopback ports: visionserve through bin/serve, or any gunicorn app.

A server runs in a session of its own (and visionserve's engines in theirs), so a signal to the process group of
what started it does not reach it. A benchmark's process (``python -m bench...``, or any process of a GPU drill's
step, which sets ``BENCH_DEADLINE``) that starts one therefore turns SIGTERM into SystemExit, once, so that its
``finally: server.stop()`` runs, bounded by ``QUICK_STOP_S``; a server killed at the end of ``stop`` takes every
process it had started with it. Under a drill's step a server is waited for until the step's deadline (less
``READY_MARGIN_S``), not beyond, so one that never gets ready fails with its log inside the step.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import requests

from app.hosting.procstat import children
from harness.processes import descendants, kill_left
from app.link.supervisor import ENGINE_MODULE

ROOT = Path(__file__).resolve().parents[1]
DEADLINE = "BENCH_DEADLINE"  # set by bench.drill for each step: when (time.time()) the step is stopped
READY_MARGIN_S = 10.0  # what a step keeps after a server that never got ready: its report, its servers' stop
QUICK_STOP_S = 5.0  # a server's stop once this process got SIGTERM, or when it never got ready, before SIGKILL
_terminating = False  # this process got SIGTERM: stop servers quickly


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM -> SystemExit, once (a second SIGTERM ends the process at once, as before)."""
    global _terminating
    _terminating = True
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise SystemExit(128 + signum)


def exit_on_sigterm_in_benchmarks() -> None:
    """In a benchmark's process (``python -m bench...``, or a drill step's: ``BENCH_DEADLINE`` set), from the main
    thread, where nothing else handles SIGTERM: turn it into SystemExit, so that the ``finally`` blocks that stop
    servers run. Test runs keep SIGTERM's default (but under a drill's step: gpu-tests, stopped alike)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    benchmark = DEADLINE in os.environ or (spec is not None and spec.name.split(".")[0] == "bench")
    if (benchmark and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


def metric_sum(scraped: Any, sample: str, **labels: str) -> float:
    """The sum of the ``sample`` values (a series' name: ``visionserve_batch_size_sum``) of a /metrics scrape's
    text, or of a registry (``scraped``: this process's, prometheus_client.REGISTRY), whose labels include
    ``labels``: a version's series summed, as PromQL's sum() would (0 where none)."""
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(scraped) if isinstance(scraped, str) else scraped.collect()
    return sum(found.value for family in families for found in family.samples
               if found.name == sample and all(found.labels.get(name) == value for name, value in labels.items()))


def free_port() -> int:
    """A loopback port nobody listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Running:
    """A server process; ``url`` is its base URL. Stopped with SIGTERM (then SIGKILL)."""

    def __init__(self, name: str, command: Sequence[str], env: dict[str, str], port: int, ready_path: str,
                 log_dir: Path, cwd: Path = ROOT) -> None:
        self.name, self.port, self.ready_path = name, port, ready_path
        self.engine_process = {**os.environ, **env}.get("VISIONSERVE_ENGINE") == "process"  # engines apart
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("w")
        self._terminated = False
        exit_on_sigterm_in_benchmarks()
        self.process = subprocess.Popen(list(command), cwd=cwd, env={**os.environ, **env}, stdout=self._log,
                                        stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        """Everything the server printed so far."""
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def wait_ready(self, timeout_s: float = 300) -> "Running":
        """Block until the ready path answers 200, at most ``timeout_s`` (under a drill's step, at most until its
        deadline less READY_MARGIN_S); raise with the log's tail if the process dies first or it is not ready by
        then, having stopped it (so does anything raised meanwhile: SystemExit on SIGTERM)."""
        step_deadline = os.environ.get(DEADLINE)
        if step_deadline:
            timeout_s = max(1.0, min(timeout_s, float(step_deadline) - READY_MARGIN_S - time.time()))
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.process.returncode}: {self.output()[-4000:]}")
                try:
                    if requests.get(self.url + self.ready_path, timeout=2).status_code == 200:
                        return self
                except requests.RequestException:  # the socket accepts before the worker has booted
                    pass
                time.sleep(0.2)
            raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f}s"
                               f"{' (the step deadline)' if step_deadline else ''}: {self.output()[-4000:]}")
        except BaseException:
            self.stop(QUICK_STOP_S)
            raise

    def worker_pids(self) -> list[int]:
        """PIDs of the main process's children (gunicorn's workers, and engines a watcher thread restarted)."""
        return children(self.process.pid)

    def http_worker_pids(self) -> list[int]:
        """``worker_pids`` but the engine processes (``python -m app.link.server SLOT``)."""
        def engine(pid: int) -> bool:
            try:
                return ENGINE_MODULE.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:  # gone meanwhile
                return True
        return [pid for pid in self.worker_pids() if not engine(pid)]

    def terminate(self) -> None:
        """SIGTERM the main process, once: a second one during gunicorn's shutdown kills it outright."""
        if not self._terminated and self.process.poll() is None:
            self._terminated = True
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM the main process (gunicorn drains its workers) unless ``terminate`` did, wait, then SIGKILL
        whatever of its process group is left (LitServe's workers, or everything after ``timeout_s``: at most
        QUICK_STOP_S once this process got SIGTERM), and once it had to kill the main process, every process that
        had descended from it (engines, in sessions of their own); returns the main exit code."""
        started = descendants(self.process.pid)  # before it ends: its orphans would be re-parented
        self.terminate()
        try:
            code = self.process.wait(min(timeout_s, QUICK_STOP_S) if _terminating else timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if code is None:  # killed before it could stop what it started (a master that stopped stops its engines)
            kill_left(started)
            code = self.process.wait()
        self._log.close()
        return code


def gunicorn_command(app: str) -> list[str]:
    """gunicorn with the project's config, serving the WSGI app ``app`` (module:attribute)."""
    return [str(Path(sys.executable).with_name("gunicorn")), "-c", "gunicorn.conf.py", app]


def visionserve(weights: Path, log_dir: Path, checkout: Path = ROOT, gunicorn_args: Sequence[str] = (),
                **settings: str) -> Running:
    """Our service through bin/serve (of ``checkout``: this one, or another one's code to compare with), the command
    `make serve` and the container run, ``gunicorn_args`` after it; with a short shutdown drain unless ``settings``
    say otherwise (the default 5 s keeps the listener open for a load balancer to notice, and nothing but the caller
    sends to these servers: each stop would wait 5 s for no one)."""
    port = free_port()
    env = {"VISIONSERVE_WEIGHTS_DIR": str(weights), "VISIONSERVE_BIND": f"127.0.0.1:{port}",
           "VISIONSERVE_DEVICE": "cpu", "VISIONSERVE_LOG_LEVEL": "warning", "VISIONSERVE_SHUTDOWN_DRAIN_S": "0.5",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           **{f"VISIONSERVE_{k.upper()}": v for k, v in settings.items()}}
    return Running("visionserve", ["bin/serve", *gunicorn_args], env, port, "/readyz", log_dir, cwd=checkout)
