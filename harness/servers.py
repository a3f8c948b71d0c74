"""Start and stop servers as subprocesses on free loopback ports: visionserve through bin/serve, or any gunicorn app."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import requests

from app.hosting.procstat import children
from app.link.supervisor import ENGINE_MODULE

ROOT = Path(__file__).resolve().parents[1]


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
        self.process = subprocess.Popen(list(command), cwd=cwd, env={**os.environ, **env}, stdout=self._log,
                                        stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        """Everything the server printed so far."""
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def wait_ready(self, timeout_s: float = 300) -> "Running":
        """Block until the ready path answers 200; raise with the log's tail if the process dies first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}: {self.output()[-4000:]}")
            try:
                if requests.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return self
            except requests.RequestException:  # the socket accepts before the worker has booted
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready after {timeout_s}s: {self.output()[-4000:]}")

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
        whatever of its process group is left (LitServe's workers, or everything after ``timeout_s``); returns the
        main exit code."""
        self.terminate()
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if code is None:
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
