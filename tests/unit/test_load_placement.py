"""One way to load a version for a device and dtype, shared by the server and models.predict: the loaded module's
weights are where and what its inputs will be (models.predict --device cuda once fed CUDA inputs to CPU weights)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.architectures import split_outputs
from models.export.load import load_model


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *(b for b in module.buffers() if b.is_floating_point())]


@pytest.mark.parametrize("weights_format", ["torchscript", "state_dict"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_loaded_weights_are_on_the_device_and_in_the_dtype_asked(small_weights: Path, weights_format: str,
                                                                     dtype: str) -> None:
    loaded = load_model(small_weights, weights_format=weights_format, device="cpu", dtype=dtype)
    tensors = _tensors(loaded.module)
    assert tensors and {(t.device, t.dtype) for t in tensors} == {(loaded.device, loaded.dtype)}
    assert loaded.dtype == getattr(torch, dtype)
    pixels = torch.zeros(2, *loaded.manifest.preprocess.input_shape, dtype=loaded.dtype, device=loaded.device)
    logits, _ = split_outputs(loaded.module(pixels))
    assert logits.shape == (2, loaded.manifest.num_classes)  # inputs placed as the weights run


@pytest.mark.gpu
@pytest.mark.parametrize("weights_format", ["torchscript", "state_dict"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_on_cuda_every_format_loads_onto_the_gpu(small_weights: Path, weights_format: str, dtype: str) -> None:
    loaded = load_model(small_weights, weights_format=weights_format, device="cuda", dtype=dtype)
    assert {(t.device.type, t.dtype) for t in _tensors(loaded.module)} == {("cuda", getattr(torch, dtype))}
