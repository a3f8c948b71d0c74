"""LitServe serving the same weights with its batching on, for the benchmark's comparison.

Run by the benchmark in its own venv:
    python -m bench.serving.litserve_app PORT WEIGHTS_DIR MAX_BATCH_SIZE BATCH_TIMEOUT_S WORKERS
Requests are JSON {"image": "<base64 JPEG>"}: LitServe reads JSON or form bodies, not raw image bodies.
"""
from __future__ import annotations

import base64
import sys
from pathlib import Path
from typing import Any

import litserve as ls
import torch

from app.engine.decoding.image import image_to_tensor
from app.engine.loaded.predictor import Predictor
from bench.serving.limit import LIMITS


class ImageAPI(ls.LitAPI):
    """decode -> batch -> predict -> unbatch -> encode, with the same decode and model as visionserve."""

    def __init__(self, weights: Path, **batching: Any) -> None:
        super().__init__(**batching)
        self.weights = weights

    def setup(self, device: str) -> None:
        # PyTorch's fastest form of the model (frozen TorchScript, as visionserve ran it before ONNX Runtime):
        # what a PyTorch user of this framework gets at best. `python -m bench` also probes visionserve serving it.
        self.predictor = Predictor.load(self.weights, weights_format="torchscript", device="cpu",
                                        jit_optimize=True)

    # No annotation on purpose: LitServe then hands over the parsed JSON body (it reads annotations as FastAPI types).
    def decode_request(self, request) -> torch.Tensor:  # noqa: ANN001
        return image_to_tensor(base64.b64decode(request["image"]), self.predictor.transform, LIMITS)

    def batch(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(inputs)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.predictor.probabilities(x)

    def unbatch(self, output: torch.Tensor) -> list[torch.Tensor]:
        return list(output)

    def encode_response(self, output: torch.Tensor) -> dict[str, Any]:
        scores, indices = output.topk(5)
        return {"predictions": [{"label": self.predictor.labels[i], "score": s}
                                for s, i in zip(scores.tolist(), indices.tolist())]}


if __name__ == "__main__":
    port, weights, max_batch_size, batch_timeout, workers = sys.argv[1:6]
    api = ImageAPI(Path(weights), max_batch_size=int(max_batch_size), batch_timeout=float(batch_timeout))
    ls.LitServer(api, accelerator="cpu", workers_per_device=int(workers), timeout=120).run(
        port=int(port), generate_client_file=False)
