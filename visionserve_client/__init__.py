"""A small Python client for visionserve (requests only; no torch).

    from visionserve_client import Client
    with Client("http://localhost:8000") as c:
        print(c.predict("cat.jpg", top_k=3).label)

CLI: ``python -m visionserve_client predict cat.jpg cup.jpg --url http://localhost:8000 --top-k 3 [--json]``.
"""
from visionserve_client.api import Client, ImageInput
from visionserve_client.errors import UsageError, VisionServeError
from visionserve_client.types import ClassScore, Embedding, Explanation, ModelInfo, Overlay, Prediction

__all__ = ["Client", "ClassScore", "Embedding", "Explanation", "ImageInput", "ModelInfo", "Overlay", "Prediction",
           "UsageError", "VisionServeError"]
