"""What a finished inference reports: Server-Timing and X-Batch-Size headers, and the access log's fields."""
from __future__ import annotations

import torch
from flask import Response, g

from app.engine.batching.types import BatchResult
from app.engine.call import Served


def _server_timing(decode_ms: float, results: list[BatchResult[torch.Tensor]]) -> str:
    queue_ms = max(r.queued_s for r in results) * 1000
    # Images of one request may run in several batches; count each batch's forward pass once.
    batches = {r.batch_id: r for r in results}.values()
    infer_ms = sum(r.run_s for r in batches) * 1000
    sizes = "+".join(str(r.batch_size) for r in batches)
    return (f'decode;dur={decode_ms:.2f}, queue;dur={queue_ms:.2f}, inference;dur={infer_ms:.2f}, '
            f'batch;desc="{sizes}"')


def annotate(response: Response, served: Served) -> Response:
    """Add the timing headers to ``response`` and hand the per-stage figures to the access log."""
    g.served = served  # for the trace's stage spans (app/web/tracing.py)
    results, decode_ms = served.results, served.decode_s * 1000
    response.headers["Server-Timing"] = _server_timing(decode_ms, results)
    response.headers["X-Batch-Size"] = ",".join(str(r.batch_size) for r in results)
    g.log_fields.update({"images": len(results), "batch_sizes": [r.batch_size for r in results],
                         "decode_ms": round(decode_ms, 2),
                         "queue_ms": round(max(r.queued_s for r in results) * 1000, 2),
                         "inference_ms": round(max(r.run_s for r in results) * 1000, 2)})
    return response
