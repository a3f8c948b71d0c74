"""The server the fixtures start (tests/conftest.py's ``start_server`` and ``live_server``)."""
from __future__ import annotations

from pathlib import Path

from harness.servers import Running, visionserve


def serve(weights: Path, log_dir: Path, **settings: str) -> Running:
    """The service on ``weights`` through bin/serve (harness/servers.py's ``visionserve``, which the benchmarks
    start it with too), with the configured batch cap, info logs, one worker and no warm-up by default (tests that
    want more say so: each warm-up ran every batch size, about 0.65 s of CPU per worker start on the 2-core VM, in
    some 130 worker starts of a run; the canary still runs before ready)."""
    defaults = {"auto_batch_size": "false", "log_level": "info", "workers": "1", "warmup": "false"}
    return visionserve(weights, log_dir, **(defaults | settings))
