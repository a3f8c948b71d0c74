"""Forward passes replayed as CUDA graphs (Settings.cuda_graphs, app/engine/loaded/graphs.py): one graph per batch
size the batcher runs, captured at warm-up, giving the eager forward's answers. On the CPU the capture is a fake that
replays the forward eagerly on the same fixed tensors, so the bookkeeping (sizes, padding, copies out, the fallback)
is tested everywhere; on CUDA the real graphs are compared with eager."""
from __future__ import annotations

import logging
import threading
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
    graphed.graphs = GraphedForward(graphed._rows, capture=capture)
    eager.warmup(MAX_BATCH, repeats=1)
    graphed.warmup(MAX_BATCH, repeats=1)
    assert graphed.graphs is not None and graphed.graphs.batch_sizes == graphed.batch_shapes(MAX_BATCH) == [1, 2, 4, 8]
    capture.replayed_inputs.clear()
    answers = {}
    for rows in range(MAX_BATCH, 0, -1):  # largest first: a smaller batch meets the rows a larger one left
        batch = _batch(rows, seed=rows)
        answers[rows] = graphed.predict_batch(batch)
        torch.testing.assert_close(answers[rows], eager.predict_batch(batch), rtol=0, atol=1e-6)
        replayed = capture.replayed_inputs[-1]  # the padded size's graph, with the batch and zeros after it
        assert replayed.shape[0] == graphed._padded_size(rows)
        assert torch.equal(replayed[:rows], batch) and not replayed[rows:].any()
    assert len(capture.replayed_inputs) == MAX_BATCH  # every batch went through a graph
    # each answer is the rows' own copy: later replays into the same fixed output leave it as it was
    torch.testing.assert_close(answers[3], eager.predict_batch(_batch(3, seed=3)), rtol=0, atol=1e-6)


@pytest.mark.parametrize("captured_before_the_failure", [0, 2])
def test_a_capture_that_fails_leaves_the_forward_passes_eager(small_weights: Path, caplog: pytest.LogCaptureFixture,
                                                              captured_before_the_failure: int) -> None:
    capture = ReplayingCapture()

    def refusing(forward: Forward, fixed_input: torch.Tensor, pool: object) -> tuple[Callable[[], None],
                                                                                      torch.Tensor]:
        nonlocal captured_before_the_failure
        if not captured_before_the_failure:
            raise RuntimeError("operation not permitted when stream is capturing")
        captured_before_the_failure -= 1
        return capture(forward, fixed_input, pool)

    eager, graphed = _padded(small_weights), _padded(small_weights)
    graphed.graphs = GraphedForward(graphed._rows, capture=refusing)
    eager.warmup(MAX_BATCH, repeats=1)
    with caplog.at_level(logging.WARNING, logger="app.engine.loaded.predictor"):
        graphed.warmup(MAX_BATCH, repeats=1)
    assert graphed.graphs is None
    assert "forward passes stay eager: CUDA graph capture failed: operation not permitted" in caplog.text
    capture.replayed_inputs.clear()
    for rows in (8, 5, 1):  # sizes captured before the failure too: none replays
        batch = _batch(rows, seed=rows)
        torch.testing.assert_close(graphed.predict_batch(batch), eager.predict_batch(batch), rtol=0, atol=1e-6)
    assert not capture.replayed_inputs


def test_a_predictor_replays_its_batches_only_once_each_warmed_shape_up_to_the_cap_has_its_graph(
        small_weights: Path) -> None:
    eager, graphed, unwarmed = _padded(small_weights), _padded(small_weights), _padded(small_weights)
    for predictor in (graphed, unwarmed):
        predictor.graphs = GraphedForward(predictor._rows, capture=ReplayingCapture())
    assert not graphed.replays_batches_up_to(MAX_BATCH)  # nothing captured before warm-up
    for predictor in (eager, graphed):
        predictor.warmup(MAX_BATCH, repeats=1)
    assert graphed.replays_batches_up_to(MAX_BATCH) and not eager.replays_batches_up_to(MAX_BATCH)
    assert not graphed.replays_batches_up_to(MAX_BATCH + 1)  # a batch past every warmed shape would run eagerly
    assert not unwarmed.replays_batches_up_to(MAX_BATCH)  # WARMUP off: no shape warmed, none captured
    assert graphed.graphs is not None
    del graphed.graphs._captured[4]  # a shape batches are padded to, without its graph: an eager pass would run
    assert not graphed.replays_batches_up_to(MAX_BATCH)


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


class _Syncing(torch.nn.Module):
    """A module no graph can hold: it reads a value back to the CPU in its forward pass."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, batch: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        outputs = self.inner(batch)  # the logits, or (logits, embedding) from a model that answers one
        logits = outputs[0] if isinstance(outputs, tuple) else outputs
        if logits.abs().sum().item() < 0:  # the read-back no capture allows; never true
            raise AssertionError("a negative sum of magnitudes")
        return outputs


@pytest.mark.gpu
def test_on_cuda_a_module_that_cannot_be_captured_stays_eager_on_its_own_stream(small_weights: Path) -> None:
    loaded = Predictor.load(small_weights, weights_format="state_dict", device="cuda", max_batch_size=MAX_BATCH)
    syncing = Predictor(_Syncing(loaded.module), loaded.manifest, device="cuda", weights_format="state_dict",
                        cuda_graphs=True)
    syncing.warmup(MAX_BATCH, repeats=1)
    torch.cuda.empty_cache()  # the allocator knows the failed capture is over (PyTorch refuses this during one)
    loaded.warmup(MAX_BATCH, repeats=1)
    assert syncing.graphs is None
    assert torch.cuda.current_stream() == torch.cuda.default_stream()  # the capture's side stream was left
    batch = _batch(5, seed=5)
    torch.testing.assert_close(syncing.predict_batch(batch), loaded.predict_batch(batch), rtol=0, atol=1e-5)


@pytest.mark.gpu
def test_on_cuda_a_version_captures_while_another_serves_beside_it(small_weights: Path) -> None:
    from app.engine.loaded.graphs import CAPTURE_PRIORITY, capture_stream
    from harness.photos import jpeg, photo
    from models.data.jpeg import decode_jpegs, decode_stream

    serving = Predictor.load(small_weights, weights_format="torchscript", device="cuda", max_batch_size=MAX_BATCH)
    serving.warmup(MAX_BATCH, repeats=1)
    loading = Predictor.load(small_weights, weights_format="torchscript", device="cuda", max_batch_size=MAX_BATCH,
                             cuda_graphs=True)
    stop, failures, served = threading.Event(), [], [0]
    encoded = torch.frombuffer(bytearray(jpeg(photo("chelsea"), (64, 48))), dtype=torch.uint8)
    device = torch.device("cuda", torch.cuda.current_device())  # as a tensor's device names it

    def serve() -> None:  # a live version's batches, allocating and decoding JPEGs as they go, while the other one
        while not stop.is_set():  # captures
            try:
                (pixels,) = decode_jpegs([encoded], device)
                assert pixels is not None and tuple(pixels.shape) == (3, 48, 64)
                serving.predict_batch(_batch(3 + served[0] % 5, seed=served[0]))
                served[0] += 1
            except Exception as exc:  # noqa: BLE001 - what the live version would have answered with
                failures.append(exc)
                return

    beside = threading.Thread(target=serve)
    beside.start()
    try:
        loading.warmup(MAX_BATCH, repeats=1)
    finally:
        stop.set()
        beside.join()
    assert not failures and served[0] > 0
    assert loading.graphs is not None and loading.graphs.batch_sizes == loading.batch_shapes(MAX_BATCH)
    # each from a pool of its own, drawn once: the capture never took the stream the thread beside it decoded on
    assert capture_stream(device) != decode_stream(device)
    if torch.cuda.Stream.priority_range()[1] <= CAPTURE_PRIORITY:  # a pool of its own, as on an H100
        assert (capture_stream(device).priority, decode_stream(device).priority) == (CAPTURE_PRIORITY, 0)


@pytest.mark.parametrize("highest, expected", [(-3, "its own"), (-1, "the default")])
def test_each_device_captures_on_one_stream_drawn_once_from_a_pool_no_serving_stream_uses(
        monkeypatch: pytest.MonkeyPatch, highest: int, expected: str) -> None:
    # PyTorch hands a pool's 32 streams out in turn: a capture stream drawn per capture would soon be a serving
    # batch's or a JPEG decode's, and their work would be captured into the graph (or fail it)
    from app.engine.loaded import graphs
    from app.engine.loaded.version import BATCH_STREAM_PRIORITY
    from tests.support.fakes import PooledStreams

    streams = PooledStreams(highest)
    monkeypatch.setattr(torch.cuda, "Stream", streams.Stream)
    monkeypatch.setattr(graphs, "_capture_streams", {})
    first, second = torch.device("cuda", 0), torch.device("cuda", 1)
    stream = graphs.capture_stream(first)
    assert [graphs.capture_stream(first) for _ in range(3)] == [stream] * 3
    assert graphs.capture_stream(second) is not stream
    priority = graphs.CAPTURE_PRIORITY if expected == "its own" else 0
    assert streams.made == [(first, priority), (second, priority)]
    assert graphs.CAPTURE_PRIORITY not in (BATCH_STREAM_PRIORITY, 0)  # 0: the decoding's, ours and torchvision's


class _Capturing:
    """``torch.cuda.CUDAGraph`` without a device: a capture whose end fails as an invalidated one does."""

    under_way = False

    def capture_begin(self, pool: object, capture_error_mode: str) -> None:
        _Capturing.under_way = True

    def capture_end(self) -> None:
        raise RuntimeError("operation failed due to a previous error during capture")


def test_a_failed_capture_tells_the_allocator_it_is_over_and_lets_the_next_one_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # PyTorch before 2.12 skipped that when ending an invalidated capture raised: its allocator then refused every
    # later empty_cache (the drill's GPU has 2.11)
    import contextlib

    from app.engine.loaded import graphs
    from tests.support.fakes import PooledStreams

    streams = PooledStreams(highest=-3)
    ended: list[tuple[int, object]] = []
    monkeypatch.setattr(torch.cuda, "Stream", streams.Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams.Stream(device))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Capturing)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda index, pool: ended.append((index, pool)),
                        raising=False)
    monkeypatch.setattr(graphs, "_capture_streams", {})
    monkeypatch.setattr(_Capturing, "under_way", False)

    class OnTheGpu:
        device = torch.device("cuda", 0)

    def syncing(batch: object) -> torch.Tensor:  # runs twice before the capture, as any forward does
        if _Capturing.under_way:
            raise RuntimeError("operation not permitted when stream is capturing")
        return torch.zeros(1)

    pool = (0, 7)
    with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):  # the forward's error
        graphs.cuda_capture(syncing, OnTheGpu(), pool)  # type: ignore[arg-type]
    assert ended == [(0, pool)]
    assert graphs._capturing.acquire(blocking=False)  # the next capture may run
    graphs._capturing.release()


def test_the_cached_memory_is_released_only_between_captures(monkeypatch: pytest.MonkeyPatch) -> None:
    # PyTorch refuses empty_cache while any capture is under way in the process: a serving version's
    # out-of-memory retry skips it then, a retired version's release waits for the capture to end
    from app.engine.loaded import graphs

    released: list[bool] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: released.append(True))
    assert graphs.release_cached_memory(wait=False) and released == [True]
    with graphs._capturing:  # a capture under way
        assert not graphs.release_cached_memory(wait=False) and released == [True]
        waiting = threading.Thread(target=graphs.release_cached_memory, kwargs={"wait": True})
        waiting.start()
        waiting.join(0.2)
        assert waiting.is_alive() and released == [True]
    waiting.join(5)
    assert released == [True, True]
