"""Explanations (#52): POST /explain answers a Grad-CAM map as JSON or drawn over the photo as a PNG, for the top
class or a named one, in a lane of its own; every bad input is a JSON 4xx naming the problem."""
from __future__ import annotations

import base64
import io
import threading
import time
import types
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import skimage.data
import torch
from flask import Flask
from flask.testing import FlaskClient
from PIL import Image

from app import EXTENSION_KEY
from app.config import Settings
from app.engine.loaded.predictor import Predictor
from app.factory import create_app
from models.explain import crop_box, feature_layer, grad_cam
from models.export.manifest import read_manifest
from models.presets import EvalPreset
from tests.support.fakes import ConvColourModel, export_tiny, tiny_manifest
from tests.support.imaging import BLUE, GREEN, RED, image_bytes


def _jpeg(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).convert("RGB").save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


CAT = _jpeg(skimage.data.chelsea())


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real export (TorchScript and state dict) of a 3-class MobileNetV3 at 32 px with distinct scores."""
    return export_tiny(tmp_path_factory.mktemp("explain"), head_scale=1e10)


def _app(weights: Path, **settings: object) -> Iterator[Flask]:
    app = create_app(Settings(**{"weights_dir": weights, "device": "cpu", "log_level": "warning", **settings}))
    yield app
    app.extensions[EXTENSION_KEY].shutdown(timeout=10)


@pytest.fixture(scope="module")
def served_app(tiny_export: Path) -> Iterator[Flask]:
    """The export served by default: TorchScript here (no ONNX file), which takes no hooks: no gradients."""
    yield from _app(tiny_export)


@pytest.fixture(scope="module")
def explain_client(served_app: Flask) -> FlaskClient:
    return served_app.test_client()


@pytest.mark.slow  # a real export (seconds)
def test_the_json_answer_holds_the_map_of_the_top_class_over_the_region_the_model_saw(
        explain_client: FlaskClient, tiny_export: Path) -> None:
    answer = explain_client.post("/explain", data=CAT, content_type="image/jpeg")
    assert answer.status_code == 200, answer.json
    body = answer.json
    top = explain_client.post("/predict?top_k=1", data=CAT, content_type="image/jpeg").json["predictions"][0]
    assert (body["explained"]["index"], body["explained"]["label"]) == (top["index"], top["label"])
    # the same model (eager against TorchScript) on the same pixels (the version's decode path): the same score
    assert body["explained"]["score"] == pytest.approx(top["score"], abs=2e-5)
    # TorchScript takes no hooks: the gradients are the state dict's
    assert (body["method"], body["weights"]) == ("grad-cam", "state_dict")
    grid = np.array(body["grid"])
    assert grid.ndim == 2 and grid.min() >= 0 and grid.max() == pytest.approx(1)
    preset = read_manifest(tiny_export).preprocess
    assert tuple(body["crop"].values()) == crop_box(451, 300, preset)  # chelsea is 451 x 300
    assert answer.headers["X-Explained-Index"] == str(top["index"])


@pytest.mark.slow  # a real export (seconds)
def test_it_equals_grad_cam_on_the_state_dict_computed_offline(explain_client: FlaskClient,
                                                                tiny_export: Path) -> None:
    from app.engine.decoding.image import DecodeLimits
    from app.engine.decoding.tensor import image_to_tensor_path
    from models.export.load import load_model
    from models.presets import TensorEvalTransform

    loaded = load_model(tiny_export, weights_format="state_dict", device="cpu")
    preset = loaded.manifest.preprocess
    pixels = image_to_tensor_path(CAT, TensorEvalTransform(preset), DecodeLimits())  # as the CPU's requests are
    offline = grad_cam(loaded.module, feature_layer(loaded.module, preset.input_shape), pixels, index=1)
    served = explain_client.post("/explain?class_index=1", data=CAT, content_type="image/jpeg").json
    assert served["explained"]["index"] == 1 and np.allclose(served["grid"], offline.grid, atol=1e-3)


@pytest.mark.slow  # a real export (seconds)
def test_a_named_class_by_label_in_every_request_form(explain_client: FlaskClient) -> None:
    by_query = explain_client.post("/explain?label=b", data=CAT, content_type="image/jpeg").json
    by_form = explain_client.post("/explain", data={"image": (io.BytesIO(CAT), "cat.jpg"), "class_index": "1"},
                                  content_type="multipart/form-data").json
    by_json = explain_client.post("/explain", json={"image": base64.b64encode(CAT).decode(), "label": "b"}).json
    assert by_query["explained"]["label"] == by_form["explained"]["label"] == by_json["explained"]["label"] == "b"
    assert by_query["grid"] == by_form["grid"] == by_json["grid"]


@pytest.mark.slow  # a real export (seconds)
def test_the_png_is_the_overlay_on_the_crop(explain_client: FlaskClient, tiny_export: Path) -> None:
    answer = explain_client.post("/explain?format=png", data=CAT, content_type="image/jpeg")
    assert answer.status_code == 200 and answer.mimetype == "image/png"
    # the format in each request form (before: a JSON body's was 422 "format is a query parameter", a form's taken)
    as_form = explain_client.post("/explain", data={"image": (io.BytesIO(CAT), "cat.jpg"), "format": "png"},
                                  content_type="multipart/form-data")
    as_json = explain_client.post("/explain", json={"image": base64.b64encode(CAT).decode(), "format": "png"})
    assert as_form.data == as_json.data == answer.data
    refused = explain_client.post("/explain?format=json", json={"image": base64.b64encode(CAT).decode(),
                                                                "format": "png"})
    assert refused.json["error"]["message"] == ("format is given twice, 'png' in the body and 'json' in the query: "
                                                "send it once")
    overlay = Image.open(io.BytesIO(answer.data))
    left, top, right, bottom = crop_box(451, 300, read_manifest(tiny_export).preprocess)
    assert overlay.size == (right - left, bottom - top) and overlay.mode == "RGB"
    assert answer.headers["X-Explained-Class"] in ("a", "b", "c")


@pytest.mark.slow  # a real export (seconds)
@pytest.mark.parametrize("query, body, content_type, code, fragment", [
    ("?class_index=3", CAT, "image/jpeg", "invalid_request", "from 0 to 2"),
    ("?class_index=x", CAT, "image/jpeg", "invalid_request", "integer"),
    ("?label=dog", CAT, "image/jpeg", "invalid_request", "'dog' is not one of"),
    ("?label=a&class_index=0", CAT, "image/jpeg", "invalid_request", "not both"),
    ("?format=gif", CAT, "image/jpeg", "invalid_request", "json or png"),
    ("?classindex=1", CAT, "image/jpeg", "invalid_request", "unknown query parameter"),
    ("", b"not an image", "image/jpeg", "invalid_image", ""),
    ("", b"{}", "text/plain", "unsupported_media_type", ""),
])
def test_bad_input_is_a_json_4xx_naming_the_problem(explain_client: FlaskClient, query: str, body: bytes,
                                                    content_type: str, code: str, fragment: str) -> None:
    answer = explain_client.post(f"/explain{query}", data=body, content_type=content_type)
    assert 400 <= answer.status_code < 500 and answer.json["error"]["code"] == code
    assert fragment in answer.json["error"]["message"]


@pytest.mark.slow  # a real export (seconds)
def test_two_images_are_refused(explain_client: FlaskClient) -> None:
    answer = explain_client.post("/explain", data={"image": [(io.BytesIO(CAT), "a.jpg"), (io.BytesIO(CAT), "b.jpg")]},
                                 content_type="multipart/form-data")
    assert answer.status_code == 400 and "one image; 2 were sent" in answer.json["error"]["message"]


@pytest.mark.slow  # a real export (seconds)
def test_a_version_without_gradients_is_a_422_naming_what_to_export(tiny_export: Path, tmp_path: Path) -> None:
    import json
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(tiny_export, bare)
    manifest = json.loads((bare / "manifest.json").read_text())
    del manifest["files"]["state_dict"]  # TorchScript alone: no module with gradients to explain with
    (bare / "manifest.json").write_text(json.dumps(manifest))
    for app in _app(bare, weights_format="torchscript"):
        answer = app.test_client().post("/explain", data=CAT, content_type="image/jpeg")
        assert answer.status_code == 422 and answer.json["error"]["code"] == "no_gradients"
        assert "export it again with python -m models.export" in answer.json["error"]["message"]
        # predictions are not affected
        assert app.test_client().post("/predict", data=CAT, content_type="image/jpeg").status_code == 200


def test_a_model_without_a_feature_map_is_a_422(client: FlaskClient) -> None:
    answer = client.post("/explain", data=image_bytes(RED), content_type="image/jpeg")  # ColourModel: channel means
    assert answer.status_code == 422 and "no convolutional feature map" in answer.json["error"]["message"]


@pytest.mark.slow  # a real export (seconds)
def test_an_eager_version_explains_on_a_copy_never_the_module_its_batches_run(tiny_export: Path) -> None:
    for app in _app(tiny_export, weights_format="state_dict"):
        service = app.extensions[EXTENSION_KEY]
        served = service.loaded_version().predictor.module
        answer = app.test_client().post("/explain", data=CAT, content_type="image/jpeg")
        assert answer.status_code == 200 and answer.json["weights"] == "state_dict"
        explainer = service.loaded_version().explainer()
        theirs = {p.data_ptr() for p in explainer.module.parameters()}
        assert explainer.module is not served and not theirs & {p.data_ptr() for p in served.parameters()}


@pytest.mark.slow  # a real export (seconds)
@pytest.mark.parametrize("decode_path", ["tensor", "pil"])
def test_an_explanation_on_a_cpu_path_decodes_its_photo_once_into_predict_s_pixels(tiny_export: Path,
                                                                                   decode_path: str) -> None:
    # Before: twice, its pixels as a request's and then the photo for its size and overlay (a 40 MP PNG's
    # explanation took 1.5x its prediction: a new user's trial)
    from unittest import mock

    from app.engine.decoding import decoders

    for app in _app(tiny_export, decode_path=decode_path, weights_format="state_dict"):
        client = app.test_client()
        top = client.post("/predict?top_k=1", data=CAT, content_type="image/jpeg").json["predictions"][0]
        with mock.patch.object(decoders, "image_to_tensor_path", wraps=decoders.image_to_tensor_path) as tensor, \
                mock.patch.object(decoders, "image_to_tensor", wraps=decoders.image_to_tensor) as pil:
            for png in (False, True):
                answer = client.post(f"/explain?format={'png' if png else 'json'}", data=CAT,
                                     content_type="image/jpeg")
                assert answer.status_code == 200
                explained = (int(answer.headers["X-Explained-Index"]), float(answer.headers["X-Explained-Score"]))
                assert explained == (top["index"], top["score"])  # the same pixels, the same version: its score
        assert tensor.call_count == pil.call_count == 0


@pytest.mark.slow  # a real export (seconds)
def test_a_version_is_ready_to_explain_before_it_serves_when_told(tiny_export: Path) -> None:
    # Before: its copy with gradients was made on the first /explain, 1-4 s of that request on the bundled model (a
    # short deadline's 504; a new user's trial)
    for app in _app(tiny_export, explain_at_start=True):
        assert app.extensions[EXTENSION_KEY].loaded_version()._explainer is not None
    for app in _app(tiny_export):  # (by default: no copy for a service that never explains)
        version = app.extensions[EXTENSION_KEY].loaded_version()
        assert version._explainer is None
        assert app.test_client().post("/explain", data=CAT, content_type="image/jpeg").status_code == 200
        assert version._explainer is not None


@pytest.mark.gpu
def test_on_cuda_a_version_s_explanations_are_made_in_its_load_and_measured_with_it(tiny_export: Path) -> None:
    # Made on a thread after the load had measured the version's device memory and let go of its lock, a second
    # process's load could pass its memory check and then run out (a review of EXPLAIN_AT_START)
    for app in _app(tiny_export, device="cuda", weights_format="state_dict", explain_at_start=True):
        version = app.extensions[EXTENSION_KEY].loaded_version()
        assert version._explainer is not None and version.device_memory_bytes is not None
        assert version.device_memory_bytes >= 2 * version.predictor.weights_bytes  # its weights and their copy


@pytest.mark.slow  # a real export (seconds)
def test_the_lane_refuses_past_its_queue_at_once_with_retry_after(tiny_export: Path) -> None:
    for app in _app(tiny_export, explain_concurrency=1, explain_queue_size=0):
        service = app.extensions[EXTENSION_KEY]
        explainer = service.loaded_version().explainer()
        release, entered = threading.Event(), threading.Event()
        real = explainer.explain

        def held(*args: object, **kwargs: object) -> object:
            entered.set()
            release.wait(10)
            return real(*args, **kwargs)

        explainer.explain = held  # type: ignore[method-assign]
        first: list[int] = []
        worker = threading.Thread(target=lambda: first.append(
            app.test_client().post("/explain", data=CAT, content_type="image/jpeg").status_code))
        worker.start()
        assert entered.wait(10)
        refused = app.test_client().post("/explain", data=CAT, content_type="image/jpeg")
        predicted = app.test_client().post("/predict", data=CAT, content_type="image/jpeg")  # not in the lane
        release.set()
        worker.join(10)
        assert refused.status_code == 429 and "Retry-After" in refused.headers
        assert predicted.status_code == 200 and first == [200]


def test_the_crop_box_is_the_eval_transform_s_region() -> None:
    preset = EvalPreset(resize_size=256, crop_size=224)
    assert crop_box(512, 256, preset) == (144, 16, 368, 240)  # short side 256: the centre 224 as it is
    assert crop_box(300, 600, preset) == (19, 169, 281, 431)  # short side 300: 224 x 300 / 256 = 262.5 wide


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
@pytest.mark.parametrize("weights_format", ["torchscript", "state_dict"])
def test_a_bfloat16_version_decoded_in_its_batch_is_explained_in_float32_as_a_float32_one(
        tiny_export: Path, weights_format: str) -> None:
    # on the CPU as on CUDA (the H200 drill of 12-04: maps 0.94 against 0.998): the gradients of float32 weights
    # (not the bfloat16 version's rounded back) on float32 pixels (not its batch's bfloat16 ones)
    maps = {}
    for dtype in ("float32", "bfloat16"):
        for app in _app(tiny_export, dtype=dtype, weights_format=weights_format, decode_path="device",
                        warmup=False):
            answer = app.test_client().post("/explain?class_index=1", data=CAT, content_type="image/jpeg")
            assert answer.status_code == 200, answer.json
            maps[dtype] = np.array(answer.json["grid"])
    assert np.allclose(maps["bfloat16"], maps["float32"], atol=1e-3), maps


@pytest.mark.slow  # a real export (seconds)
def test_a_channels_last_version_is_explained_as_a_contiguous_one(tiny_export: Path) -> None:
    # MEMORY_FORMAT: the explainer's copy keeps the version's layout; its hooks and gradients give the same map
    found = {}
    for layout in ("contiguous", "channels_last"):
        for app in _app(tiny_export, weights_format="state_dict", memory_format=layout, warmup=False):
            client = app.test_client()
            assert client.get("/v1/models").json["models"][0]["memory_format"] == layout
            answer = client.post("/explain?class_index=1", data=CAT, content_type="image/jpeg")
            assert answer.status_code == 200, answer.json
            found[layout] = np.array(answer.json["grid"])
    assert np.allclose(found["channels_last"], found["contiguous"], atol=1e-5), found


@pytest.mark.gpu
@pytest.mark.parametrize("weights_format", ["torchscript", "state_dict"])
def test_on_cuda_in_bfloat16_the_map_is_the_cpu_s(tiny_export: Path, weights_format: str) -> None:
    """The explainer takes float32 gradients on the version's device whatever its served dtype."""
    maps = {}
    for device, dtype in (("cpu", "float32"), ("cuda", "bfloat16")):
        for app in _app(tiny_export, device=device, dtype=dtype, weights_format=weights_format):
            answer = app.test_client().post("/explain?class_index=1", data=CAT, content_type="image/jpeg")
            assert answer.status_code == 200, answer.json
            maps[device] = np.array(answer.json["grid"])
    assert np.allclose(maps["cuda"], maps["cpu"], atol=0.02)


def _conv_app(settings: Settings, **changes: object) -> Iterator[Flask]:
    app = create_app(settings.model_copy(update=changes), Predictor(ConvColourModel(), tiny_manifest(), device="cpu"))
    yield app
    app.extensions[EXTENSION_KEY].shutdown(timeout=5)


class BfloatLeansOther(ConvColourModel):
    """ConvColourModel whose answer in bfloat16 leans to 'other': the served bfloat16 forward pass and the float32
    copy explanations take gradients of disagree on the top class, as bfloat16's rounding moves a near tie."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        if x.dtype == torch.bfloat16:
            logits = logits + torch.tensor([0.0, 0.0, 0.0, 14.0], dtype=x.dtype)  # other 9, red 8 (a red photo)
        return logits


def test_the_explained_class_and_score_are_predict_s_whatever_the_served_dtype(settings: Settings) -> None:
    # Before: the class and its score came from the float32 copy of the weights, so under bfloat16 /explain could
    # name a class /predict did not answer, with another score.
    predictor = Predictor(BfloatLeansOther(), tiny_manifest(), device="cpu", dtype=torch.bfloat16)
    app = create_app(settings.model_copy(update={"dtype": "bfloat16"}), predictor)
    try:
        photo = image_bytes(RED, size=(32, 24))
        top = app.test_client().post("/predict?top_k=4", data=photo, content_type="image/jpeg").json["predictions"][0]
        answer = app.test_client().post("/explain", data=photo, content_type="image/jpeg")
        assert answer.status_code == 200, answer.json
        assert top["label"] == "other" and answer.json["explained"]["label"] == "other"
        assert answer.json["explained"]["score"] == pytest.approx(top["score"], abs=1e-6)
        named = app.test_client().post("/explain?label=red", data=photo, content_type="image/jpeg").json
        scores = {row["label"]: row["score"] for row in top["top_k"]}
        assert scores["red"] > 0.1 and named["explained"]["score"] == pytest.approx(scores["red"], abs=1e-6)
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_explanations_at_once_each_keep_their_own_feature_map(settings: Settings) -> None:
    for app in _conv_app(settings, explain_concurrency=2, explain_queue_size=8):
        photos = {colour: image_bytes(colour, size=(32, 24)) for colour in (RED, GREEN, BLUE)}
        alone = {colour: app.test_client().post("/explain?class_index=0", data=photo,
                                                content_type="image/jpeg").json["grid"]
                 for colour, photo in photos.items()}
        answers: list[tuple[tuple[int, int, int], int, object]] = []

        def ask(colour: tuple[int, int, int]) -> None:
            for _ in range(5):
                answer = app.test_client().post("/explain?class_index=0", data=photos[colour],
                                                content_type="image/jpeg")
                answers.append((colour, answer.status_code, answer.json.get("grid")))

        threads = [threading.Thread(target=ask, args=(colour,)) for colour in (RED, GREEN, BLUE, RED)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert len(answers) == 20 and all(status == 200 for _, status, _ in answers), answers[:3]
        assert all(grid == alone[colour] for colour, _, grid in answers)  # never another thread's map


def test_the_crop_is_in_the_photo_s_own_pixels_after_a_reduced_scale_decode(settings: Settings) -> None:
    large = image_bytes(RED, size=(4000, 3000))  # decoded at 1/2 or less (JPEG_DRAFT_MIN_SIDE)
    for app in _conv_app(settings, jpeg_draft_min_side=1024, max_pixels=20_000_000, max_body_bytes=8 << 20):
        answer = app.test_client().post("/explain", data=large, content_type="image/jpeg")
        assert answer.status_code == 200, answer.json
        assert tuple(answer.json["crop"].values()) == crop_box(4000, 3000, tiny_manifest().preprocess)


def test_a_class_index_in_json_must_be_an_integer(settings: Settings) -> None:
    red = base64.b64encode(image_bytes(RED, size=(32, 24))).decode()
    for app in _conv_app(settings):
        for value in (True, 1.0, "1"):
            answer = app.test_client().post("/explain", json={"image": red, "class_index": value})
            assert answer.status_code == 422 and answer.json["error"]["code"] == "validation_error", value


def test_explanations_waiting_when_the_lane_closes_are_503_not_500(settings: Settings) -> None:
    from app.engine.explain import ExplainLane
    from app.errors import NotReady

    lane = ExplainLane(settings.model_copy(update={"explain_concurrency": 1, "explain_queue_size": 2}))
    entered, release = threading.Event(), threading.Event()

    class Held:
        def explain(self, *args: object) -> None:
            entered.set()
            release.wait(10)

    version = types.SimpleNamespace(name="colour", version="test", explainer=Held)
    outcomes: list[object] = []

    def ask() -> None:
        try:
            outcomes.append(lane.explain(version, b"", None, False, 10))  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - what the caller gets is the point
            outcomes.append(exc)

    first = threading.Thread(target=ask)
    first.start()
    assert entered.wait(10)
    second = threading.Thread(target=ask)
    second.start()
    time.sleep(0.2)  # waiting behind the first
    lane.close()
    second.join(10)
    release.set()
    first.join(10)
    with pytest.raises(NotReady):
        lane.explain(version, b"", None, False, 10)  # type: ignore[arg-type]
    assert isinstance(outcomes[0], NotReady) and outcomes[0].status == 503  # the waiting one
    assert outcomes[1] is None  # the running one ended as it would have
