"""Property tests: whatever bytes arrive, decoding raises nothing but our own 4xx errors, on every decode path (PIL,
tensor, and the device path's header check and batch decode, run here on the CPU)."""
from __future__ import annotations

import io

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from app.engine.decoding.image import DecodeLimits, image_to_tensor
from app.engine.decoding.device import check_header, decode_batch
from app.engine.decoding.tensor import image_to_tensor_path
from app.errors import ServiceError
from models.presets import EvalPreset, TensorEvalTransform, eval_transform

LIMITS = DecodeLimits(max_pixels=4_000_000, max_aspect_ratio=20, jpeg_draft_min_side=64)
TRANSFORM = eval_transform(EvalPreset(resize_size=16, crop_size=16))
TENSOR_TRANSFORM = TensorEvalTransform(EvalPreset(resize_size=16, crop_size=16))
PATHS = {
    "pil": lambda data: image_to_tensor(data, TRANSFORM, LIMITS),
    "tensor": lambda data: image_to_tensor_path(data, TENSOR_TRANSFORM, LIMITS),
    "device": lambda data: decode_batch([check_header(data, LIMITS)], torch.device("cpu"), TENSOR_TRANSFORM,
                                        torch.float32)[0],
}


def _seed(fmt: str) -> bytes:
    buffer = io.BytesIO()
    image = Image.radial_gradient("L").convert("RGB").resize((48, 40))
    image.save(buffer, format=fmt)
    return buffer.getvalue()


SEEDS = [_seed(fmt) for fmt in ("JPEG", "PNG", "GIF", "BMP", "WEBP")]


def _decode_or_4xx(data: bytes | bytearray) -> None:
    for path, decode in PATHS.items():
        try:
            tensor = decode(data)
        except ServiceError as exc:
            assert 400 <= exc.status < 500, (path, exc)
        else:
            assert tuple(tensor.shape) == (3, 16, 16), path


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2048))
def test_arbitrary_bytes(data: bytes) -> None:
    _decode_or_4xx(data)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.sampled_from(SEEDS), edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)),
                                                     max_size=12), cut=st.integers(0, 10_000))
def test_mutated_real_images(seed: bytes, edits: list[tuple[int, int]], cut: int) -> None:
    """Valid files with flipped bytes and cut tails reach far deeper into the codecs than random bytes."""
    data = bytearray(seed)
    for position, value in edits:
        data[position % len(data)] = value
    _decode_or_4xx(data[: max(1, len(data) - cut % len(data))])  # a bytearray, as the engine's link hands images


@pytest.mark.parametrize("seed", SEEDS)
def test_the_seeds_themselves_decode(seed: bytes) -> None:
    for decode in PATHS.values():
        assert tuple(decode(seed).shape) == (3, 16, 16)
