"""Service.admit and Call.infer, the one request path both protocols take: readiness, routing, arrivals, limits,
decoding, the queue."""
from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from app.config import Settings
from app.engine.loaded.predictor import Predictor
from app.engine.service import Service
from app.engine.versions.sources import DirectorySource, GivenSource
from app.errors import BadRequest, InvalidImage, NotReady, TooManyImages
from models.export import checks
from models.export.checks import ModelLoadError
from tests.support.fakes import ColourModel, infer, wait_until
from tests.support.imaging import BLUE, RED, image_bytes


def test_images_are_decoded_queued_and_answered_in_order(service: Service) -> None:
    served = infer(service, [image_bytes(RED), image_bytes(BLUE)])
    assert (served.model, served.version, served.labels) == ("colour", "test", ["red", "green", "blue", "other"])
    assert served.probabilities().argmax(axis=1).tolist() == [0, 2]  # red, blue
    assert served.decode_s > 0 and all(size >= 1 for size in served.batch_sizes())


def test_preprocessed_tensors_skip_decoding(service: Service) -> None:
    red = service.loaded_version().decoder.prepare(image_bytes(RED))
    served = infer(service, tensors=[red, red])
    assert served.decode_s == 0.0 and served.probabilities().argmax(axis=1).tolist() == [0, 0]


def test_the_request_counts_as_arriving_while_it_reads_and_decodes(service: Service) -> None:
    seen: list[int] = []

    with service.admit() as call:
        seen.append(service.loaded_version().arrivals.count())  # while the protocol reads its body
        call.infer([image_bytes(RED)], timeout_s=5.0)
    assert seen == [1] and service.loaded_version().arrivals.count() == 0


def test_a_lone_request_takes_the_inline_path(service: Service) -> None:
    # What a route that forgot to report its arrival lost: every batch waited max_wait_ms on the worker thread.
    before = service.loaded_version().batcher.batches_inline
    infer(service, [image_bytes(RED)])
    assert service.loaded_version().batcher.batches_inline == before + 1


def test_a_failing_read_leaves_no_arrival_behind(service: Service) -> None:
    with pytest.raises(BadRequest), service.admit():
        raise BadRequest("bad field")  # the protocol refused its body
    with pytest.raises(InvalidImage):
        infer(service, [b"not an image"])
    assert service.loaded_version().arrivals.count() == 0


@pytest.mark.parametrize("images, tensors, error", [
    ([], [], BadRequest),
    ([b"x"], [torch.zeros(3, 8, 8)], BadRequest),
    ([image_bytes(RED)] * 5, [], TooManyImages),  # max_images is 4: the one check, for every protocol
])
def test_the_runner_enforces_the_input_rules(service: Service, images: list[bytes], tensors: list[torch.Tensor],
                                             error: type[Exception]) -> None:
    with pytest.raises(error):
        infer(service, images, tensors)


def test_not_ready_is_refused_before_the_body_is_read(service: Service) -> None:
    service.begin_drain()
    service.stop_serving()  # (its drain's window over: until then a draining service still admits)
    read_called: list[bool] = []
    with pytest.raises(NotReady), service.admit():
        read_called.append(True)
    assert not read_called


def test_a_service_started_in_the_background_answers_while_it_loads(settings: Settings,
                                                                     predictor: Predictor) -> None:
    release = threading.Event()
    failures: list[BaseException] = []

    class Slow(GivenSource):
        def load(self, name: str, version: str) -> Predictor:
            release.wait(10)
            return predictor

    service = Service.start(settings, Slow(predictor), failures.append)
    try:
        assert service.alive and not service.loaded and not service.ready
        with pytest.raises(NotReady, match="still loading"):
            infer(service, [image_bytes(RED)])
        with pytest.raises(NotReady):
            service.loaded_version().predictor  # noqa: B018 - what a protocol touching the model meets while it loads
        release.set()
        wait_until(lambda: service.ready)
        assert infer(service, [image_bytes(RED)]).probabilities().argmax() == 0
        assert not failures
    finally:
        release.set()
        service.shutdown(timeout=5)


def test_a_failed_background_load_is_handed_to_on_error(settings: Settings) -> None:
    failures: list[BaseException] = []
    service = Service.start(settings, DirectorySource(settings), failures.append)  # an empty directory
    wait_until(lambda: bool(failures) and not service.alive)  # the loader thread ends: liveness fails
    assert isinstance(failures[0], ModelLoadError) and "no manifest.json" in str(failures[0])
    message = str(failures[0])
    # an empty folder (a new volume for a repository: pods crash-looped, told of `make weights`; an SRE's trial)
    assert "the folder is empty; write a model into it before the server starts (python -m models.export " \
           f"--repository {settings.resolved_weights_dir()}" in message and "runs/NAME/export" in message
    assert "make weights" not in message and "--default --out" not in message  # that fills weights/ only
    assert "\n" not in message
    assert not service.ready
    (settings.resolved_weights_dir() / "README.txt").write_text("not an export")  # a folder holding other things
    message = checks.no_export_message(settings.resolved_weights_dir())
    assert "it holds no export; check VISIONSERVE_WEIGHTS_DIR" in message and "runs/NAME/export" in message
    assert "run `make weights`" not in message


def test_only_the_default_weights_folder_is_told_to_run_make_weights(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    default = tmp_path / "weights"
    default.mkdir()
    monkeypatch.setattr(checks, "DEFAULT_WEIGHTS_DIR", default.resolve())
    with pytest.raises(ModelLoadError) as refused:
        checks.read_checked_manifest(default)
    assert str(refused.value) == (
        f"no manifest.json in {default}: it holds no export; run `make weights` to export the bundled default model "
        "into it, or set VISIONSERVE_WEIGHTS_DIR to an export's folder (e.g. runs/NAME/export) or a model repository")
    with pytest.raises(ModelLoadError, match="the folder does not exist; check VISIONSERVE_WEIGHTS_DIR"):
        checks.read_checked_manifest(tmp_path / "runs" / "typo")
    # a run's folder for its export's: said which folder inside it to serve (before: "holds no export" alone)
    run = tmp_path / "runs" / "mine"
    (run / "export").mkdir(parents=True)
    (run / "export" / "manifest.json").write_text("{}")
    with pytest.raises(ModelLoadError) as refused:
        checks.read_checked_manifest(run)
    assert str(refused.value).startswith(f"no manifest.json in {run}: it holds no export, but {run / 'export'} does: "
                                         f"set VISIONSERVE_WEIGHTS_DIR={run / 'export'}; check VISIONSERVE_WEIGHTS_DIR")
    # a run's checkpoint for its export's folder (before: "[Errno 20] Not a directory: '.../best.pt/manifest.json'")
    (run / "best.pt").write_bytes(b"")
    with pytest.raises(ModelLoadError) as refused:
        checks.read_checked_manifest(run / "best.pt")
    assert str(refused.value).startswith(f"no manifest.json in {run / 'best.pt'}: it is a file, not a folder, but "
                                         f"{run / 'export'} does: set VISIONSERVE_WEIGHTS_DIR={run / 'export'}")


def test_a_hand_edited_manifest_is_refused_in_one_line(tmp_path: Path) -> None:
    # Before: pydantic's dump, a line an error and "For further information visit https://errors.pydantic.dev/...".
    import json

    from tests.support.fakes import tiny_manifest

    manifest = tiny_manifest().model_dump(mode="json")
    manifest["preprocess"]["crop_size"] = "big"
    manifest["labels"] = 5
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelLoadError) as refused:
        checks.read_checked_manifest(tmp_path)
    said = str(refused.value)
    assert "\n" not in said and "errors.pydantic.dev" not in said, said
    assert said.startswith(f"{tmp_path}/manifest.json is invalid: labels: "), said
    assert "; preprocess.crop_size: " in said, said


@pytest.mark.parametrize(("change", "said"), [
    ({"std": [0, 0.2, 0.2]}, "are on the 0..1 scale of the pixels"),  # a division by zero
    ({"mean": [123.7, 116.3, 103.5], "std": [58.4, 57.1, 57.4]}, "(on 0..255: divide them by 255)"),
    ({"labels": ["red", " ", "blue"]}, "labels [1] are empty"),
])
def test_a_hand_written_manifest_s_nonsense_is_refused_saying_what_to_fix(tmp_path: Path, change: dict,
                                                                          said: str) -> None:
    # Before: each served (a user's own manifest): near-uniform answers, every image one class, an empty label
    import json

    from tests.support.fakes import tiny_manifest

    manifest = tiny_manifest().model_dump(mode="json")
    if "labels" in change:
        manifest["labels"] = change["labels"][:len(manifest["labels"])] + manifest["labels"][len(change["labels"]):]
    else:
        manifest["preprocess"].update(change)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelLoadError, match=re.escape(said)):
        checks.read_checked_manifest(tmp_path)


def test_a_deadline_spent_before_the_request_reached_the_engine_is_504_not_429(service: Service) -> None:
    # A request that waited out its whole deadline before the engine judged it (a busy engine under ENGINE=process,
    # its deadline counted from its arrival at the HTTP worker): 504, as it was before a passed deadline became
    # "too short" once batches ran (a review found 429 "the server is busy ... when its images queued", inviting the
    # bundled client to retry a request whose time was spent).
    from app.errors import DeadlineExceeded

    infer(service, [image_bytes(RED)])  # a batch ran: the batcher estimates an image's own inference
    with service.admit(images=1) as call:
        with pytest.raises(DeadlineExceeded, match="it passed before its images were decoded"):
            call.prepare([image_bytes(RED)], timeout_s=1.0, arrived=time.monotonic() - 5)


def test_a_drain_waits_for_the_requests_inside_the_runner(service: Service, model: ColourModel) -> None:
    model.batch_sizes.clear()  # warm-up's batches
    model.gate = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(infer, service, [image_bytes(RED)])
        wait_until(lambda: bool(model.batch_sizes))
        service.begin_drain()
        assert not service.wait_drained(0.0, 0.2)  # the first request is still inside; the window (0 s) is over
        with pytest.raises(NotReady, match="shutting down") as refused:
            infer(service, [image_bytes(RED)])
        assert refused.value.headers["Connection"] == "close"
        model.gate.set()
        assert service.wait_drained(0.0, 5.0) and busy.result(timeout=5)


def test_images_of_a_client_that_hung_up_are_dropped_before_their_forward_pass(service: Service,
                                                                               model: ColourModel) -> None:
    from app.errors import ClientGone
    from app.metrics import BATCHER_EVENTS

    dropped = BATCHER_EVENTS.labels("colour", "test", "client_gone")  # the served version's
    dropped_before = dropped._value.get()
    model.batch_sizes.clear()  # warm-up's batches
    model.gate = threading.Event()
    gone = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(infer, service, [image_bytes(RED)])
        wait_until(lambda: bool(model.batch_sizes))  # the first batch is in its forward pass, holding the model
        second = pool.submit(infer, service, [image_bytes(BLUE)] * 3, client_gone=gone.is_set)
        wait_until(lambda: service.loaded_version().batcher.depth == 3)
        gone.set()
        with pytest.raises(ClientGone):
            second.result(timeout=5)
        model.gate.set()
        first.result(timeout=5)
    wait_until(lambda: service.loaded_version().batcher.depth == 0)
    assert model.batch_sizes == [1]  # the three queued images never ran
    assert dropped._value.get() == dropped_before + 3
