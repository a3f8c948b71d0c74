"""Start the real gunicorn server on a free loopback port for end-to-end tests."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from bench.servers import ROOT, free_port


class Server:
    """A gunicorn process serving ``weights`` with extra VISIONSERVE_* settings; output goes to a log file."""

    def __init__(self, weights: Path, log_path: Path, **settings: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = (os.environ | {"VISIONSERVE_WEIGHTS_DIR": str(weights), "VISIONSERVE_BIND": f"127.0.0.1:{self.port}",
                             "VISIONSERVE_DEVICE": "cpu", "VISIONSERVE_AUTO_BATCH_SIZE": "false"}
               | {f"VISIONSERVE_{k.upper()}": v for k, v in settings.items()})
        gunicorn = Path(sys.executable).with_name("gunicorn")
        self._log = log_path.open("w")
        self.process = subprocess.Popen([str(gunicorn), "-c", "gunicorn.conf.py", "app.wsgi:app"], cwd=ROOT,
                                        env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        """Everything the server printed so far."""
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 180) -> "Server":
        """Block until /readyz answers 200; fail with the server's output if it dies first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"gunicorn exited with {self.process.returncode}:\n{self.output()}")
            try:
                if requests.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return self
            except requests.RequestException:  # the socket accepts before the worker has booted
                pass
            time.sleep(0.2)
        pytest.fail(f"server never became ready:\n{self.output()}")

    def worker_pids(self) -> list[int]:
        """PIDs of the master's worker processes."""
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        return [int(pid) for pid in children]

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=timeout)
        self._log.close()
        return code


def rss_bytes(pid: int) -> int:
    """Resident memory of a process."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")
