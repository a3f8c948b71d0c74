"""The server the fixtures start (tests/conftest.py's ``start_server`` and ``live_server``)."""
from __future__ import annotations

from pathlib import Path

from harness.servers import Running, visionserve


def serve(weights: Path, log_dir: Path, **settings: str) -> Running:
    """The service on ``weights`` through bin/serve (harness/servers.py's ``visionserve``, which the benchmarks
    start it with too), with the configured batch cap, info logs and one worker by default (tests that want more
    say so)."""
    defaults = {"auto_batch_size": "false", "log_level": "info", "workers": "1"}
    return visionserve(weights, log_dir, **(defaults | settings))
