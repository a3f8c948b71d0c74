"""The baseline most tutorials show: a Flask app that runs one forward pass per request, no batching.

Same weights, decode limits and eval transform as visionserve (its PIL decode path, `DECODE_PATH=pil`), so the
comparison isolates the serving design.
It reads a raw image body, or JSON ``{"image": "<base64>"}`` the way such tutorials do (``request.get_json()``,
``base64.b64decode``). Run by the benchmark as: gunicorn bench.serving.naive_app:app (with the same worker settings as visionserve).
"""
from __future__ import annotations

import base64
import os
from pathlib import Path

import torch
from flask import Flask, jsonify, request

from app.engine.decoding.image import image_to_tensor
from app.engine.loaded.predictor import Predictor
from bench.serving.limit import LIMITS

app = Flask(__name__)
# PyTorch's fastest form of the model (frozen TorchScript, as visionserve ran it before ONNX Runtime):
# what a PyTorch user of this framework gets at best. `python -m bench` also probes visionserve serving it.
_predictor = Predictor.load(Path(os.environ["NAIVE_WEIGHTS_DIR"]), weights_format="torchscript", device="cpu",
                            jit_optimize=True)


@app.post("/predict")
def predict():  # noqa: ANN201 - tutorial style on purpose
    data = base64.b64decode(request.get_json()["image"]) if request.is_json else request.get_data()
    image = image_to_tensor(data, _predictor.transform, LIMITS)
    with torch.inference_mode():
        probabilities = _predictor.probabilities(image.unsqueeze(0))[0]
    scores, indices = probabilities.topk(5)
    return jsonify(predictions=[{"label": _predictor.labels[i], "score": s}
                                for s, i in zip(scores.tolist(), indices.tolist())])


@app.get("/healthz")
def healthz():  # noqa: ANN201
    return {"status": "ok"}
