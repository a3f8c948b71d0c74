"""Measured tuning: the batch cap chosen at warm-up (applied and reported), and the forward-pass threads."""
from __future__ import annotations

import contextlib
import logging
import re
from pathlib import Path
from typing import Iterator

import pytest

from app import EXTENSION_KEY

from app.factory import create_app
from app.config import Settings
from app.engine.loaded.predictor import Predictor
from app.engine.batching.tuning import choose_batch_cap, run_spread
from app.engine.service import Service
from tests.support.fakes import tiny_manifest
from tests.support.imaging import image_bytes


def test_cap_is_the_largest_batch_within_5_percent_of_the_best() -> None:
    assert choose_batch_cap({1: 10.0, 2: 19.0, 3: 20.0, 4: 20.5, 5: 18.0}) == 4
    assert choose_batch_cap({1: 10.0, 2: 20.0, 4: 40.0, 8: 80.0}) == 8  # a GPU: keeps rising
    assert choose_batch_cap({1: 30.0, 2: 25.0}) == 1
    # Measured at warm-up on 2 cores: Lite0 on ONNX Runtime, flat (served best with the larger cap); on TorchScript,
    # a cliff at 7 images.
    assert choose_batch_cap({1: 106.0, 2: 112.0, 3: 110.0, 4: 111.0, 5: 108.0, 6: 108.0, 7: 107.0, 8: 106.0}) == 7
    assert choose_batch_cap({1: 64.0, 2: 77.0, 3: 78.0, 4: 78.0, 5: 76.0, 6: 75.0, 7: 41.0, 8: 40.0}) == 6


def test_only_a_slowdown_larger_than_the_warm_up_s_noise_caps_the_batches() -> None:
    # Before (an operator's trial): a worker warming up beside a busy one measured a flat curve unsteadily and capped
    # its batches anywhere from 1 to 7 of 8, kept until it restarted. The runs of a size differing by 10% (the
    # noise), a dip of 10% is no slowdown; a cliff to half is.
    flat = {1: 81.0, 2: 62.0, 3: 100.0, 4: 90.0, 5: 88.0, 6: 85.0, 7: 92.0, 8: 89.0}
    assert choose_batch_cap(flat) == 3 and choose_batch_cap(flat, noise=0.1) == 8
    cliff = {1: 64.0, 2: 77.0, 3: 78.0, 4: 78.0, 5: 76.0, 6: 75.0, 7: 41.0, 8: 40.0}
    assert choose_batch_cap(cliff, noise=0.1) == 6 and choose_batch_cap(cliff, noise=0.5) == 8  # a test too noisy


def test_the_warm_up_s_noise_is_how_much_its_runs_of_a_size_differ(predictor: Predictor,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    steady = {1: [0.010, 0.0101, 0.0102], 2: [0.020, 0.0201, 0.0199]}
    busy = {1: [0.010, 0.015, 0.016], 2: [0.020, 0.031, 0.029], 3: [0.03, 0.03, 0.09]}
    assert run_spread(steady) == pytest.approx(0.0075, rel=0.01) and run_spread(busy) == pytest.approx(0.45)
    assert run_spread({1: [0.01], 2: [0.02]}) == 0  # one run each: nothing to compare
    told = []
    monkeypatch.setattr("app.engine.loaded.predictor.run_spread", lambda runs: told.append(runs) or 0.25)
    predictor.warmup(2, repeats=3)  # what the warm-up's runs gave, as measured
    assert predictor.warmup_noise == 0.25 and sorted(told[0]) == [1, 2] and all(len(t) == 3 for t in told[0].values())


def test_measured_cap_is_applied_and_shown(settings: Settings, predictor: Predictor,
                                           monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    measured = {1: 100.0, 2: 180.0, 3: 200.0, 4: 150.0}
    monkeypatch.setattr(predictor, "warmup", lambda max_batch_size, **_: {k: measured[k] for k in range(1, 5)})
    with caplog.at_level(logging.INFO, logger="app.engine.loaded.version"):
        app = create_app(settings.model_copy(update={"auto_batch_size": True}), predictor)
    try:
        # the rule said (before: "larger batches were slower", where a smaller one may have been the fastest)
        assert "batch cap 3, the largest batch within 5% of the best images/s; larger ones were slower (1: 100 " \
               "img/s, 2: 180 img/s, 3: 200 img/s, 4: 150 img/s)" in caplog.text
        assert app.extensions[EXTENSION_KEY].loaded_version().batcher.max_batch_size == 3
        batching = app.test_client().get("/v1/models").get_json()["models"][0]["batching"]
        assert (batching["max_batch_size"], batching["batch_cap"]) == (4, 3)
        assert batching["profile"] == {"1": 100.0, "2": 180.0, "3": 200.0, "4": 150.0}
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_a_later_start_takes_the_cap_its_first_start_in_this_server_measured(
        settings: Settings, predictor: Predictor, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    # Before (an operator's trial): an engine killed under load was restarted and warmed up beside the busy HTTP
    # workers: its curve capped the batches at 3 where the first start had measured 8, until the next restart.
    from app.hosting import control

    curves = iter([{1: 100.0, 2: 180.0, 3: 200.0, 4: 150.0},  # the first start: a cap of 3
                   {1: 100.0, 2: 60.0, 3: 55.0, 4: 50.0},  # a start beside busy work: it would cap at 1
                   {1: 100.0, 2: 60.0, 3: 55.0, 4: 50.0}])  # (a server of its own: measured)
    monkeypatch.setattr(predictor, "warmup", lambda max_batch_size, **_: next(curves))
    kept = settings.model_copy(update={"auto_batch_size": True, "control_dir": tmp_path / "control"})
    (tmp_path / "control").mkdir()
    caps = []
    for run_settings in (kept, kept, kept.model_copy(update={"control_dir": tmp_path / "other"})):
        (tmp_path / "other").mkdir(exist_ok=True)
        with caplog.at_level(logging.INFO, logger="app.engine.loaded.version"):
            app = create_app(run_settings, predictor)
        try:
            caps.append(app.extensions[EXTENSION_KEY].loaded_version().batcher.max_batch_size)
        finally:
            app.extensions[EXTENSION_KEY].shutdown(timeout=5)
    assert caps == [3, 3, 1]
    assert "batch cap 3, as its first start in this server measured it" in caplog.text
    control.clear_stale(tmp_path / "control")  # a server starting on a kept CONTROL_DIR measures afresh
    assert not list((tmp_path / "control").glob(control.BATCH_CAPS))


def test_a_warm_up_too_noisy_to_cap_by_says_the_batches_stay_at_the_ceiling(
        settings: Settings, predictor: Predictor, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # Before (an operator's trial): "... differed by 79% (a busy machine): only a batch size slower than 0% of the
    # best caps the batches", and no cap line.
    monkeypatch.setattr(predictor, "warmup", lambda max_batch_size, **_: {1: 100.0, 2: 180.0, 3: 200.0, 4: 50.0})
    monkeypatch.setattr(predictor, "warmup_noise", 0.79, raising=False)
    with caplog.at_level(logging.INFO, logger="app.engine.loaded.version"):
        app = create_app(settings.model_copy(update={"auto_batch_size": True}), predictor)
    try:
        assert "the warm-up's runs differed by 79% (a busy machine): too much to cap the batches by: they stay at " \
               "the ceiling, 4" in caplog.text and "batch cap" not in caplog.text
        assert app.extensions[EXTENSION_KEY].loaded_version().batcher.max_batch_size == 4
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_the_automatic_ceiling_follows_the_device() -> None:
    auto = Settings(workers=1, threads=1, max_images=1)  # the queue's automatic size then rests on the ceiling
    assert auto.max_batch_size == 0
    assert (auto.batch_ceiling("cpu"), auto.batch_ceiling("cuda")) == (8, 32)
    assert (auto.resolved_queue_size("cpu"), auto.resolved_queue_size("cuda")) == (16, 64)
    assert Settings(max_batch_size=12).batch_ceiling("cuda") == 12  # a set value holds on every device


def test_a_version_on_the_cpu_batches_up_to_the_cpu_ceiling(settings: Settings, predictor: Predictor) -> None:
    sizes: list[int] = []
    predictor.warmup = lambda max_batch_size, **_: sizes.append(max_batch_size) or {}  # type: ignore[method-assign]
    auto = {"max_batch_size": 0, "queue_size": 0, "threads": 1, "max_images": 1, "warmup": True}
    app = create_app(settings.model_copy(update=auto), predictor)
    try:
        assert app.extensions[EXTENSION_KEY].loaded_version().batcher.max_batch_size == 8
        assert sizes == [8]  # warmed up to it
        batching = app.test_client().get("/v1/models").get_json()["models"][0]["batching"]
        assert (batching["max_batch_size"], batching["batch_cap"]) == (8, 8)
        assert batching["queue_size"] == 16  # two batches of the CPU's ceiling, more than one thread's one image
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


@pytest.mark.gpu
def test_a_version_on_a_gpu_batches_up_to_the_gpu_ceiling(settings: Settings, model) -> None:  # noqa: ANN001
    predictor = Predictor(model, tiny_manifest(), device="cuda")
    app = create_app(settings.model_copy(update={"device": "cuda", "max_batch_size": 0}), predictor)
    try:
        assert app.extensions[EXTENSION_KEY].loaded_version().batcher.max_batch_size == 32
        batching = app.test_client().get("/v1/models").get_json()["models"][0]["batching"]
        assert batching["max_batch_size"] == 32
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_warmup_canary_and_batches_run_on_the_batcher_thread(settings: Settings, predictor: Predictor,
                                                              model) -> None:  # noqa: ANN001
    # cuDNN keeps its tuned plans per thread: a warm-up on any other thread would leave them to the first batches.
    app = create_app(settings.model_copy(update={"inline_when_idle": False}), predictor)
    service = app.extensions[EXTENSION_KEY]
    try:
        assert model.batch_sizes[:4] == [1, 2, 3, 4] and len(model.threads) > 4  # warm-up, then the canary
        app.test_client().post("/predict", data=image_bytes())
        assert set(model.threads) == {service.loaded_version().batcher._thread.ident}
    finally:
        service.shutdown(timeout=5)


def test_the_real_warmup_profiles_every_batch_size(predictor: Predictor) -> None:
    profile = predictor.warmup(3)
    assert sorted(profile) == [1, 2, 3] and all(rate > 0 for rate in profile.values())
    assert predictor.warmed_batch_sizes == [1, 2, 3]


def test_warmup_s_batches_of_every_shape_are_views_of_one_of_the_largest(predictor: Predictor,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: a batch of zeros of each shape, the inputs alone sizes squared (MAX_BATCH_SIZE=64 held 1.2 GB of them
    # on the CPU; a misconfiguring operator's trial: 100,000 took the machine's memory)
    storages: dict[int, int] = {}
    forward = predictor._forward
    monkeypatch.setattr(predictor, "_forward", lambda batch: (
        storages.setdefault(len(batch), batch.untyped_storage().data_ptr()), forward(batch))[1])
    predictor.warmup(5, repeats=1)
    assert sorted(storages) == [1, 2, 3, 4, 5] and len(set(storages.values())) == 1


def test_warmup_times_the_sizes_in_turn_so_a_drifting_machine_slows_them_alike(predictor: Predictor,
                                                                              model) -> None:  # noqa: ANN001
    model.batch_sizes.clear()
    predictor.warmup(3, repeats=2)
    assert model.batch_sizes == [1, 2, 3, 1, 2, 3, 1, 2, 3]  # untimed round, then the timed rounds


def test_a_slow_model_s_warm_up_stops_timing_once_past_its_time_and_says_how_far_it_got(
        predictor: Predictor, model, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    # Before: five timed rounds whatever they took (a TorchServe user's model of 1.2 s a forward pass sat LOADING
    # for minutes, saying nothing)
    from app.engine.loaded import predictor as predictor_module

    model.batch_sizes.clear()
    model.delay_s = 0.02
    with caplog.at_level(logging.INFO, logger=predictor_module.__name__), \
            pytest.MonkeyPatch.context() as patch:
        patch.setattr(predictor_module, "WARMUP_PROGRESS_S", 0.03)
        profile = predictor.warmup(3, repeats=5, timing_s=0.1)
    assert model.batch_sizes == [1, 2, 3, 1, 2, 3]  # the untimed round and one timed round: past 0.1 s by then
    assert sorted(profile) == [1, 2, 3]
    assert re.search(r"warming up colour version test: [123] of 3 batch shapes run in \d+s", caplog.text)
    assert "timed 1 round(s) of 5" in caplog.text and "(WARMUP_TIMING_S)" in caplog.text
    model.batch_sizes.clear()
    model.delay_s = 0.0
    predictor.warmup(3, repeats=2, timing_s=10)  # a fast model: every round
    assert model.batch_sizes == [1, 2, 3] * 3


def test_padded_batches_warm_powers_of_two_and_pad_up_to_the_next(model) -> None:  # noqa: ANN001
    import torch

    from tests.support.fakes import tiny_manifest

    padded = Predictor(model, tiny_manifest(), device="cpu", pad_batches=True)
    assert padded.batch_shapes(12) == [1, 2, 4, 8, 12] and padded.batch_shapes(1) == [1]
    padded.warmup(12, repeats=1)
    assert padded.warmed_batch_sizes == [1, 2, 4, 8, 12]
    model.batch_sizes.clear()
    images = torch.rand(5, 3, 8, 8)
    probs = padded.predict_batch(images)
    assert model.batch_sizes == [8]  # 5 rows ran as a warmed shape of 8
    assert probs.shape == (5, 4)
    plain = Predictor(model, tiny_manifest(), device="cpu")
    assert torch.allclose(probs, plain.predict_batch(images))  # the zero rows change no real row's answer
    assert plain.batch_shapes(3) == [1, 2, 3]  # on the CPU every size runs as it is


def test_padding_defaults_to_cuda_only(model) -> None:  # noqa: ANN001
    from tests.support.fakes import tiny_manifest

    assert Predictor(model, tiny_manifest(), device="cpu").pad_batches is False


def test_forward_threads_leave_cores_for_decoding_on_cpu() -> None:
    import torch

    from app.engine.batching.tuning import forward_threads

    assert forward_threads(0, torch.device("cpu"), cores=2) == 1
    assert forward_threads(0, torch.device("cpu"), cores=16) == 8
    assert forward_threads(0, torch.device("cuda", 0), cores=16) == 0  # torch's default
    assert forward_threads(3, torch.device("cpu"), cores=2) == 3  # an explicit setting wins


def test_lone_batches_run_inline_on_the_cpu_only() -> None:
    import torch

    from app.engine.batching.tuning import inline_batches

    assert inline_batches(True, torch.device("cpu"))
    assert not inline_batches(False, torch.device("cpu"))
    assert not inline_batches(True, torch.device("cuda", 0))  # per-thread cuDNN/cuBLAS set-up costs seconds


def test_an_engines_loop_runs_short_batches_on_the_cpu_and_on_cuda_only_where_every_batch_replays_a_graph() -> None:
    import torch

    from app.engine.batching.tuning import loop_batches

    assert loop_batches(torch.device("cpu"), replays_every_batch=False)
    assert loop_batches(torch.device("cuda", 0), replays_every_batch=True)  # one launch, no per-thread cuDNN plans
    assert not loop_batches(torch.device("cuda", 0), replays_every_batch=False)  # eager: the batcher's thread's plans


def test_a_version_on_the_cpu_lets_an_engines_loop_run_its_batches_whatever_lone_batches_do(
        settings: Settings, predictor: Predictor) -> None:
    app = create_app(settings.model_copy(update={"inline_when_idle": False}), predictor)
    service = app.extensions[EXTENSION_KEY]
    try:
        batcher = service.loaded_version().batcher
        assert batcher.runs_queued_on_caller and not batcher._inline_when_idle
    finally:
        service.shutdown(timeout=5)


@contextlib.contextmanager
def _version_on_a_gpu(settings: Settings, small_weights: Path, graphs: bool) -> Iterator[tuple[Service, Predictor]]:
    """A service with the small model on CUDA, warmed up to batches of 4, its forward passes graphed or eager."""
    gpu = settings.model_copy(update={"device": "cuda", "max_batch_size": 4, "warmup": True, "cuda_graphs": graphs})
    predictor = Predictor.load(small_weights, weights_format="torchscript", device="cuda", max_batch_size=4,
                               cuda_graphs=graphs)
    service = create_app(gpu, predictor).extensions[EXTENSION_KEY]
    try:
        yield service, predictor
    finally:
        service.shutdown(timeout=5)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_a_version_on_a_gpu_lets_an_engines_loop_run_its_batches_when_they_replay_graphs(
        settings: Settings, small_weights: Path, graphs: bool) -> None:
    with _version_on_a_gpu(settings, small_weights, graphs) as (service, predictor):
        loaded = service.loaded_version()
        assert predictor.replays_batches_up_to(4) is graphs
        assert loaded.batcher.runs_queued_on_caller is graphs and (loaded.batch_stream is not None) is graphs


@pytest.mark.gpu
def test_on_a_gpu_a_graphed_versions_batches_run_on_the_callers_thread_replayed_on_the_versions_stream(
        settings: Settings, small_weights: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # as an engine's loop runs them (Batcher.run_queued): no eager forward pass off the batcher's thread, whose tuned
    # cuDNN plans it would need, and the answers the batcher's thread gives
    import threading

    import numpy as np
    import torch

    from tests.support.fakes import wait_until

    with _version_on_a_gpu(settings, small_weights, graphs=True) as (service, predictor):
        loaded = service.loaded_version()
        batcher, graphs = loaded.batcher, predictor.graphs
        assert graphs is not None and loaded.batch_stream is not None
        replays: list[tuple[bool, int, torch.cuda.Stream]] = []
        replay = graphs.run

        def spied(batch: torch.Tensor, size: int) -> torch.Tensor | None:
            rows = replay(batch, size)
            replays.append((rows is not None, threading.get_ident(), torch.cuda.current_stream()))
            return rows

        monkeypatch.setattr(graphs, "run", spied)
        shape = loaded.signature.input_shape
        pixels = [np.random.default_rng(seed).random(shape, dtype=np.float32) for seed in range(4)]
        measured = batcher.submit_group(pixels[:1])  # the version's first batch: the batcher's thread's
        assert measured.wait(30)
        on_thread = np.array(measured.result())
        wait_until(lambda: not batcher._busy)  # the batcher's thread done with it
        for rows in range(1, 5):
            group = batcher.submit_group(pixels[:rows], defer=True)
            assert batcher.run_queued(10.0) and group.wait(0)  # run here, done at return
            # batches of 1, 2 and 4 are three graphs, whose cuDNN kernels (TF32 convolutions, chosen per shape) may
            # differ by about 1e-4; another image's row differs from this one's by 0.03 or more
            np.testing.assert_allclose(np.array(group.result())[:1], on_thread, rtol=0, atol=1e-3)
        assert [replayed for replayed, _, _ in replays] == [True] * 5  # every batch a replay, none eager
        assert replays[0][1] == batcher._thread.ident
        assert {thread for _, thread, _ in replays[1:]} == {threading.get_ident()}
        assert {stream for _, _, stream in replays} == {loaded.batch_stream}
        # a JPEG, decoded by nvJPEG in its batch (the decode's stream ordered against the batch's): on the caller's
        # thread as on the batcher's, with its answer
        jpeg = loaded.decoder.prepare(image_bytes(fmt="JPEG", size=(64, 64)))
        wait_until(lambda: not batcher._busy)
        threaded = batcher.submit_group([jpeg])
        assert threaded.wait(30)
        wait_until(lambda: not batcher._busy)
        here = batcher.submit_group([jpeg], defer=True)
        assert batcher.run_queued(10.0) and here.wait(0)
        np.testing.assert_allclose(np.array(here.result()), np.array(threaded.result()), rtol=0, atol=1e-3)
        assert replays[-2][1] == batcher._thread.ident and replays[-1][1] == threading.get_ident()
        assert replays[-1][2] == loaded.batch_stream
        # an image the device path decodes on the CPU in its batch (not a JPEG): the batcher's thread's
        wait_until(lambda: not batcher._busy)
        png = batcher.submit_group([loaded.decoder.prepare(image_bytes(fmt="PNG", size=(64, 64)))], defer=True)
        assert not batcher.run_queued(10.0) and png.wait(30) and len(png.result()) == 1
        assert replays[-1][1] == batcher._thread.ident and replays[-1][2] == loaded.batch_stream
