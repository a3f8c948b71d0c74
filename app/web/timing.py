"""What a finished inference reports: Server-Timing and X-Batch-Size headers, and the access log's fields."""
from __future__ import annotations

from flask import Response, g

from app.engine.contract import Served, stage_ms


def annotate(response: Response, served: Served) -> Response:
    """Add the timing headers to ``response`` and hand the per-stage figures to the access log."""
    context = g._get_current_object()  # not a proxy lookup per field
    context.served = served  # for the trace's stage spans (app/web/tracing.py)
    runs, decode_ms = served.batches, served.decode_s * 1000
    queue_ms, inference_ms = stage_ms(runs)
    batch_sizes = served.batch_sizes()
    sizes = "+".join(str(run.batch_size) for run in runs)
    wait_ms = getattr(context, "waited_s", 0.0) * 1000  # in its worker, before the app began on it
    response.headers["Server-Timing"] = (f'wait;dur={wait_ms:.2f}, decode;dur={decode_ms:.2f}, '
                                         f'queue;dur={queue_ms:.2f}, inference;dur={inference_ms:.2f}, '
                                         f'batch;desc="{sizes}"')
    response.headers["X-Batch-Size"] = ",".join(map(str, batch_sizes))
    context.log_fields.update({"images": len(batch_sizes), "batch_sizes": batch_sizes, "wait_ms": round(wait_ms, 2),
                               "decode_ms": round(decode_ms, 2), "queue_ms": round(queue_ms, 2),
                               "inference_ms": round(inference_ms, 2)})
    return response
