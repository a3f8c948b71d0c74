"""``python -m bench.serving.tracing_cost``: what tracing costs per request, in process (no HTTP, so the difference
shows).

The small mobilenet of the fault matrix behind the app factory, one client thread, 400 requests per round, 5
rounds each way, alternating: TRACING off (the default: no tracing code is installed) and on (spans made and
handed to an in-memory exporter, so no network is timed). Prints the median requests/s of each and their ratio.
"""
from __future__ import annotations

import statistics
import sys
import time

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app import EXTENSION_KEY

from app.factory import create_app
from app.config import Settings
from app.web.tracing import register_tracing
from bench.paths import WORK
from harness.faults import IMAGE, small_weights

ROUNDS, REQUESTS = 5, 400


def _rate(app) -> float:  # noqa: ANN001
    client = app.test_client()
    started = time.perf_counter()
    for _ in range(REQUESTS):
        assert client.post("/predict", data=IMAGE, content_type="image/jpeg").status_code == 200
    return REQUESTS / (time.perf_counter() - started)


def main() -> int:
    weights = small_weights(WORK / "faults" / "small")
    settings = Settings(weights_dir=weights, device="cpu", log_level="warning", auto_batch_size=False)
    off, on = create_app(settings), create_app(settings)
    exporter = InMemorySpanExporter()
    register_tracing(on, settings, exporter)
    for app in (off, on):
        while not app.extensions[EXTENSION_KEY].ready:
            time.sleep(0.1)
        _rate(app)  # warm
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(ROUNDS):
        for name, app in (("off", off), ("on", on)):
            rates[name].append(_rate(app))
            exporter.clear()
    med = {name: statistics.median(values) for name, values in rates.items()}
    print(f"tracing off: {med['off']:.0f} req/s, on: {med['on']:.0f} req/s (median of {ROUNDS} x {REQUESTS}); "
          f"on/off = {med['on'] / med['off']:.3f}")
    for app in (off, on):
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
