"""ONNX Runtime on the CPU, as both the export's check (models/export/onnx.py) and the server run an ONNX file."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch


def session(path: Path, threads: int = 1) -> Any:
    """An ONNX Runtime CPU session for ``path`` with ``threads`` intra-op threads, which never spin while idle
    (the cores belong to the request threads' decoding between batches)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = max(1, threads), 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3  # errors only: its warnings about unused initializers are noise here
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run_session(onnx_session: Any, batch: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Logits for a float32 (N, C, H, W) CPU batch, and the embeddings beside them when the file has that output."""
    inputs = {onnx_session.get_inputs()[0].name: batch.contiguous().numpy()}
    outputs = tuple(torch.from_numpy(np.asarray(output)) for output in onnx_session.run(None, inputs))
    return outputs if len(outputs) > 1 else outputs[0]
