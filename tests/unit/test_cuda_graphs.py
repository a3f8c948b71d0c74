"""Forward passes replayed as CUDA graphs (Settings.cuda_graphs, app/engine/loaded/graphs.py): one graph per batch
size the batcher runs, captured at warm-up, giving the eager forward's answers. On the CPU the capture is a fake that
replays the forward eagerly on the same fixed tensors, so the bookkeeping (sizes, padding, copies out, the fallback)
is tested everywhere; on CUDA the real graphs are compared with eager."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import pytest
import torch

from app.engine.loaded.graphs import Forward, GraphedForward
from app.engine.loaded.predictor import Predictor

MAX_BATCH = 8


class ReplayingCapture:
    """A capture on the CPU: replay runs ``forward`` on the fixed input into the fixed output, and records what the
    fixed input held at each replay."""

    def __init__(self) -> None:
        self.replayed_inputs: list[torch.Tensor] = []

    def __call__(self, forward: Forward, fixed_input: torch.Tensor, pool: object
                 ) -> tuple[Callable[[], None], torch.Tensor]:
        with torch.inference_mode():
            fixed_output = forward(fixed_input)

        def replay() -> None:
            self.replayed_inputs.append(fixed_input.clone())
            with torch.inference_mode():
                fixed_output.copy_(forward(fixed_input))

        return replay, fixed_output


def _padded(small_weights: Path, **options: object) -> Predictor:
    loaded = Predictor.load(small_weights, weights_format="torchscript", device="cpu", max_batch_size=MAX_BATCH,
                            **options)  # type: ignore[arg-type]
    return Predictor(loaded.module, loaded.manifest, device="cpu", weights_format="torchscript", pad_batches=True)


def _batch(rows: int, seed: int) -> torch.Tensor:
    return torch.rand(rows, 3, 64, 64, generator=torch.Generator().manual_seed(seed))


def test_each_padded_batch_size_replays_its_graph_with_the_eager_answers(small_weights: Path) -> None:
    eager, graphed = _padded(small_weights), _padded(small_weights)
    capture = ReplayingCapture()
    graphed.graphs = GraphedForward(graphed._probabilities, capture=capture)
    eager.warmup(MAX_BATCH, repeats=1)
    graphed.warmup(MAX_BATCH, repeats=1)
    assert graphed.graphs is not None and graphed.graphs.batch_sizes == graphed.batch_shapes(MAX_BATCH) == [1, 2, 4, 8]
    capture.replayed_inputs.clear()
    answers = []
    for rows in range(1, MAX_BATCH + 1):
        batch = _batch(rows, seed=rows)
        answers.append(graphed.predict_batch(batch))
        torch.testing.assert_close(answers[-1], eager.predict_batch(batch), rtol=0, atol=1e-6)
        replayed = capture.replayed_inputs[-1]  # the padded size's graph, with the batch and zeros after it
        assert replayed.shape[0] == graphed._padded_size(rows)
        assert torch.equal(replayed[:rows], batch) and not replayed[rows:].any()
    assert len(capture.replayed_inputs) == MAX_BATCH  # every batch went through a graph
    # each answer is the rows' own copy: later replays into the same fixed output leave it as it was
    torch.testing.assert_close(answers[2], eager.predict_batch(_batch(3, seed=3)), rtol=0, atol=1e-6)


def test_a_capture_that_fails_leaves_the_forward_passes_eager(small_weights: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    def refusing(forward: Forward, fixed_input: torch.Tensor, pool: object) -> tuple[Callable[[], None],
                                                                                      torch.Tensor]:
        raise RuntimeError("operation not permitted when stream is capturing")

    eager, graphed = _padded(small_weights), _padded(small_weights)
    graphed.graphs = GraphedForward(graphed._probabilities, capture=refusing)
    eager.warmup(MAX_BATCH, repeats=1)
    with caplog.at_level(logging.WARNING, logger="app.engine.loaded.predictor"):
        graphed.warmup(MAX_BATCH, repeats=1)
    assert graphed.graphs is None
    assert "forward passes stay eager: CUDA graph capture failed: operation not permitted" in caplog.text
    batch = _batch(5, seed=0)
    torch.testing.assert_close(graphed.predict_batch(batch), eager.predict_batch(batch), rtol=0, atol=1e-6)


def test_graphs_are_for_cuda_modules_only(small_weights: Path) -> None:
    assert Predictor.load(small_weights, weights_format="torchscript", device="cpu", cuda_graphs=True).graphs is None


@pytest.mark.gpu
@pytest.mark.parametrize("weights_format", ["torchscript", "state_dict"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_cuda_the_replayed_graphs_answer_as_the_eager_forward(small_weights: Path, weights_format: str,
                                                                 dtype: str) -> None:
    predictors = {graphs: Predictor.load(small_weights, weights_format=weights_format, device="cuda", dtype=dtype,
                                         max_batch_size=MAX_BATCH, cuda_graphs=graphs) for graphs in (False, True)}
    for predictor in predictors.values():
        predictor.warmup(MAX_BATCH, repeats=1)
    graphs = predictors[True].graphs
    assert predictors[False].graphs is None
    assert graphs is not None and graphs.batch_sizes == predictors[True].batch_shapes(MAX_BATCH)
    tolerance = 1e-5 if dtype == "float32" else 2e-2  # two predictors' cuDNN may pick different kernels
    for rows in range(1, MAX_BATCH + 1):
        batch = _batch(rows, seed=rows)
        for placed in (batch, batch.cuda()):  # the tensor decode path's CPU batches and the device path's
            torch.testing.assert_close(predictors[True].predict_batch(placed), predictors[False].predict_batch(placed),
                                       rtol=0, atol=tolerance)
