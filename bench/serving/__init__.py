"""Serving benchmarks: visionserve against its limit and its peers (``python -m bench``), and the measurements behind
docs/performance.md and docs/deployment.md (decode paths, formats, GPU, tracing, the request-reading worker, faults)."""
