"""One way to load a version for a device and dtype, shared by the server and models.predict: the loaded module's
weights are where and what its inputs will be (models.predict --device cuda once fed CUDA inputs to CPU weights)."""
from __future__ import annotations

import logging
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


def _laid_out_channels_last(module: torch.nn.Module) -> set[bool]:
    """For each 4-D weight of ``module``: whether it is laid out channels_last."""
    return {w.is_contiguous(memory_format=torch.channels_last) for w in module.parameters() if w.dim() == 4}


@pytest.mark.parametrize("weights_format", ["torchscript", "state_dict"])
def test_in_channels_last_the_weights_and_batches_take_the_layout_and_the_answers_stay(
        small_weights: Path, weights_format: str) -> None:
    from app.engine.loaded.predictor import Predictor

    predictors = {layout: Predictor.load(small_weights, weights_format=weights_format, device="cpu",
                                         memory_format=layout) for layout in ("contiguous", "channels_last")}
    laid_out = predictors["channels_last"]
    assert (laid_out.memory_format, predictors["contiguous"].memory_format) == ("channels_last", "contiguous")
    assert _laid_out_channels_last(laid_out.module) == {True}
    assert False in _laid_out_channels_last(predictors["contiguous"].module)  # (a 1x1 one is laid out both ways)
    batch = torch.rand(3, *laid_out.manifest.preprocess.input_shape, generator=torch.Generator().manual_seed(3))
    if weights_format == "state_dict":  # an nn.Module: what its forward pass is handed
        seen: list[bool] = []
        laid_out.module.register_forward_pre_hook(
            lambda module, args: seen.append(args[0].is_contiguous(memory_format=torch.channels_last)))
        laid_out.predict_batch(batch)
        assert seen == [True]
    torch.testing.assert_close(laid_out.predict_batch(batch), predictors["contiguous"].predict_batch(batch),
                               rtol=0, atol=1e-5)


class _FlatView(torch.nn.Module):
    """A convolution whose feature map is viewed as flat (``view``: no channels_last tensor can be), and a 3-D
    convolution beside it (``spare``: weights of rank 5, which the layout refuses) when asked."""

    def __init__(self, spare: bool) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.head = torch.nn.Linear(4 * 8 * 8, 4)
        self.spare = torch.nn.Conv3d(1, 1, 1) if spare else None

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        features = self.conv(batch)
        return self.head(features.view(features.shape[0], -1))


@pytest.mark.parametrize("spare", [False, True])
def test_a_module_that_refuses_the_layout_keeps_its_own_serves_and_the_log_says_why(
        spare: bool, caplog: pytest.LogCaptureFixture) -> None:
    from app.engine.loaded.predictor import Predictor
    from tests.support.fakes import tiny_manifest

    model = _FlatView(spare)
    with caplog.at_level(logging.WARNING, logger="app.engine.loaded.predictor"):
        predictor = Predictor(model, tiny_manifest(), device="cpu", memory_format="channels_last")
    assert predictor.memory_format == "contiguous" and "keeps the contiguous layout" in caplog.text
    assert _laid_out_channels_last(model) == {False}  # its weights as they were
    batch = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = model(batch).softmax(dim=1)
    torch.testing.assert_close(predictor.predict_batch(batch), expected, rtol=0, atol=1e-6)


def test_a_module_of_constants_keeps_the_contiguous_layout_and_the_log_says_so(
        small_weights: Path, caplog: pytest.LogCaptureFixture) -> None:
    from app.engine.loaded.predictor import Predictor

    with caplog.at_level(logging.WARNING, logger="app.engine.loaded.predictor"):
        frozen = Predictor.load(small_weights, weights_format="torchscript", device="cpu", jit_optimize=True,
                                memory_format="channels_last")  # JIT_OPTIMIZE on the CPU: weights become constants
    assert frozen.memory_format == "contiguous" and not list(frozen.module.parameters())
    assert "keeps the contiguous layout" in caplog.text
    batch = torch.rand(2, *frozen.manifest.preprocess.input_shape)
    assert frozen.predict_batch(batch).shape[0] == 2


def test_the_setting_reaches_each_loaded_version_and_v1_models_says_which_layout_it_runs(small_weights: Path) -> None:
    from app.config import Settings
    from app import EXTENSION_KEY
    from app.factory import create_app

    settings = Settings(weights_dir=small_weights, device="cpu", weights_format="state_dict", warmup=False,
                        memory_format="channels_last", log_level="warning")
    app = create_app(settings)
    try:
        (info,) = app.test_client().get("/v1/models").get_json()["models"]
        assert (info["format"], info["memory_format"]) == ("state_dict", "channels_last")
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=10)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_cuda_channels_last_replayed_graphs_answer_as_contiguous_eager_passes(small_weights: Path,
                                                                                 dtype: str) -> None:
    from app.engine.loaded.predictor import Predictor

    graphed = Predictor.load(small_weights, weights_format="torchscript", device="cuda", dtype=dtype,
                             max_batch_size=8, cuda_graphs=True, memory_format="channels_last")
    eager = Predictor.load(small_weights, weights_format="torchscript", device="cuda", dtype=dtype, max_batch_size=8)
    graphed.warmup(8, repeats=1)
    assert graphed.memory_format == "channels_last" and graphed.replays_batches_up_to(8)
    assert _laid_out_channels_last(graphed.module) == {True}
    tolerance = 1e-4 if dtype == "float32" else 2e-2  # cuDNN's channels_last kernels round in their own order
    for rows in (1, 3, 8):
        batch = torch.rand(rows, *eager.manifest.preprocess.input_shape, generator=torch.Generator().manual_seed(rows))
        for placed in (batch, batch.cuda()):
            torch.testing.assert_close(graphed.predict_batch(placed), eager.predict_batch(placed), rtol=0,
                                       atol=tolerance)
