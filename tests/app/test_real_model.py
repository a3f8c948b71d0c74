"""The bundled EfficientNet-Lite0: strict weight loading, real photos, and served == offline."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from flask import Flask
from PIL import Image

from app import EXTENSION_KEY
from app.engine.loaded.predictor import Predictor
from harness.photos import photo
from models.architectures import build_model
from models.export.checks import ModelLoadError
from models.export.manifest import read_manifest
from models.presets import eval_transform, to_rgb
from models.pretrained import lite0_weights_path, rename_lite0_keys
from tests.support.imaging import encode

pytestmark = pytest.mark.slow

# ImageNet indices: the domestic-cat classes, and the coffee classes a cup of espresso may land in.
CATS = {281: "tabby", 282: "tiger cat", 283: "Persian cat", 284: "Siamese cat", 285: "Egyptian cat"}
COFFEE = {967: "espresso", 968: "cup", 504: "coffee mug"}


def _photo_jpeg(name: str) -> bytes:
    return encode(photo(name), "JPEG", quality=95)


def test_package_weights_load_with_no_missing_or_unexpected_keys() -> None:
    state = rename_lite0_keys(torch.load(lite0_weights_path(), map_location="cpu", weights_only=True))
    model = build_model("efficientnet_lite0", 1000)
    result = model.load_state_dict(state, strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert set(state) == set(model.state_dict())


def test_manifest_describes_the_export(real_weights: Path) -> None:
    manifest = read_manifest(real_weights)
    assert manifest.arch == "efficientnet_lite0" and manifest.num_classes == 1000
    assert manifest.labels[281] == "tabby" and manifest.labels[967] == "espresso"
    assert manifest.preprocess.crop_size == 224 and manifest.preprocess.interpolation == "bicubic"
    assert manifest.preprocess.mean[0] == pytest.approx(127 / 255) and manifest.preprocess.std[0] == pytest.approx(128 / 255)
    assert set(manifest.files) == {"torchscript", "state_dict"}


def _post_photo(app: Flask, name: str, top_k: int = 5) -> dict:
    response = app.test_client().post(f"/predict?top_k={top_k}", data=_photo_jpeg(name), content_type="image/jpeg")
    assert response.status_code == 200, response.get_json()
    return response.get_json()["predictions"][0]


@pytest.mark.parametrize("name, classes", [("chelsea", CATS), ("coffee", COFFEE)])
def test_real_photos_get_the_right_imagenet_class(real_app: Flask, name: str, classes: dict[int, str]) -> None:
    prediction = _post_photo(real_app, name)
    assert prediction["index"] in classes, prediction
    assert prediction["label"] == classes[prediction["index"]]
    assert prediction["score"] > 0.3


def _offline_probabilities(weights_dir: Path, data: bytes, tensor_path: bool = False) -> torch.Tensor:
    """Inference without the server: the state dict in the registry's arch, on the image decoded and transformed by
    PIL (what evaluate() runs), or by torchvision's decoder and the manifest's tensor transform (the server's CPU
    default, DECODE_PATH=auto)."""
    import io

    from torchvision.io import ImageReadMode, decode_jpeg

    from models.presets import TensorEvalTransform

    manifest = read_manifest(weights_dir)
    model = build_model(manifest.arch, manifest.num_classes)
    model.load_state_dict(torch.load(weights_dir / manifest.files["state_dict"].path, weights_only=True))
    if tensor_path:
        pixels = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        batch = TensorEvalTransform(manifest.preprocess)(pixels).unsqueeze(0)
    else:
        batch = eval_transform(manifest.preprocess)(to_rgb(Image.open(io.BytesIO(data)))).unsqueeze(0)
    with torch.inference_mode():
        return model.eval()(batch).softmax(1)[0]


@pytest.mark.parametrize("name", ["chelsea", "coffee", "astronaut", "rocket"])
def test_served_predictions_equal_offline_inference(real_app: Flask, real_weights: Path, name: str) -> None:
    served = _post_photo(real_app, name)
    scores_served = [c["score"] for c in served["top_k"]]
    offline = _offline_probabilities(real_weights, _photo_jpeg(name), tensor_path=True)
    scores, indices = offline.topk(5)
    assert [c["index"] for c in served["top_k"]] == indices.tolist()
    assert np.allclose(scores_served, scores.tolist(), atol=1e-5)  # exactly what the server runs
    # and what PIL and evaluate() give, within the decode paths' measured difference (docs/performance.md)
    scores, indices = _offline_probabilities(real_weights, _photo_jpeg(name)).topk(5)
    assert [c["index"] for c in served["top_k"]] == indices.tolist()
    assert np.allclose(scores_served, scores.tolist(), atol=2e-3)


def test_torchscript_and_state_dict_give_the_same_outputs(real_weights: Path) -> None:
    scripted = Predictor.load(real_weights, weights_format="torchscript", device="cpu")
    eager = Predictor.load(real_weights, weights_format="state_dict", device="cpu")
    batch = torch.stack([scripted.transform(photo(n)) for n in ("chelsea", "coffee")])
    assert torch.allclose(scripted.predict_batch(batch), eager.predict_batch(batch), atol=1e-6)


@pytest.fixture
def weights_copy(real_weights: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "w"
    shutil.copytree(real_weights, copy)
    return copy


def _edit_manifest(weights_dir: Path, **changes: object) -> None:
    path = weights_dir / "manifest.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


@pytest.mark.parametrize("fmt", ["torchscript", "state_dict"])
def test_corrupt_weights_stop_the_load(weights_copy: Path, fmt: str) -> None:
    target = weights_copy / read_manifest(weights_copy).files[fmt].path
    target.write_bytes(target.read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match="sha256"):
        Predictor.load(weights_copy, weights_format=fmt, device="cpu")


def test_missing_files_stop_the_load(weights_copy: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no manifest.json"):
        Predictor.load(tmp_path / "empty", device="cpu")
    (weights_copy / read_manifest(weights_copy).files["torchscript"].path).unlink()
    with pytest.raises(ModelLoadError, match="missing"):
        Predictor.load(weights_copy, weights_format="torchscript", device="cpu")


def test_label_count_that_does_not_match_the_model_stops_the_load(weights_copy: Path) -> None:
    _edit_manifest(weights_copy, labels=["a", "b", "c"])
    with pytest.raises(ModelLoadError, match="3 labels"):
        Predictor.load(weights_copy, weights_format="torchscript", device="cpu")
    with pytest.raises(ModelLoadError, match=r"2 of another shape \(the head classifier.bias: \(1000,\) against "
                                             r"\(3,\), another class count\)"):
        Predictor.load(weights_copy, weights_format="state_dict", device="cpu")


def test_manifest_cannot_point_outside_its_directory(weights_copy: Path) -> None:
    manifest = json.loads((weights_copy / "manifest.json").read_text())
    manifest["files"]["state_dict"]["path"] = "../../etc/passwd"
    (weights_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelLoadError, match="bare file name"):
        Predictor.load(weights_copy, device="cpu")


@pytest.mark.parametrize("name", ["chelsea", "coffee", "rocket"])
def test_reduced_scale_jpeg_decoding_keeps_predictions(real_app: Flask, name: str) -> None:
    """The default draft setting (1024) must not change a 12 MP photo's top-1 or top-5 set, and move no probability by 0.01."""
    from app.config import Settings
    from app.engine.decoding.image import DecodeLimits, image_to_tensor
    from harness.photos import jpeg, photo

    service = real_app.extensions[EXTENSION_KEY]
    data = jpeg(photo(name), (4000, 3000))
    draft = DecodeLimits(max_pixels=20_000_000, max_aspect_ratio=20,
                         jpeg_draft_min_side=Settings().jpeg_draft_min_side)
    full = DecodeLimits(max_pixels=20_000_000, max_aspect_ratio=20, jpeg_draft_min_side=0)
    batch = torch.stack([image_to_tensor(data, service.loaded_version().predictor.transform, limits) for limits in (draft, full)])
    p_draft, p_full = service.loaded_version().predictor.probabilities(batch)
    assert int(p_draft.argmax()) == int(p_full.argmax())
    assert set(p_draft.topk(5).indices.tolist()) == set(p_full.topk(5).indices.tolist())
    assert float((p_draft - p_full).abs().max()) < 0.01


def test_jit_optimize_keeps_the_answers(real_weights: Path) -> None:
    plain = Predictor.load(real_weights, weights_format="torchscript", device="cpu")
    optimized = Predictor.load(real_weights, weights_format="torchscript", device="cpu", jit_optimize=True)
    assert "aten::batch_norm" in str(plain.module.inlined_graph)
    assert "aten::batch_norm" not in str(optimized.module.graph)  # folded into the convolutions
    batch = torch.stack([plain.transform(photo(n)) for n in ("chelsea", "coffee")])
    # Folding BatchNorm into the convolutions reorders float operations: equal to rounding, same classes.
    expected, got = plain.predict_batch(batch), optimized.predict_batch(batch)
    assert torch.allclose(expected, got, atol=1e-4)
    assert torch.equal(expected.argmax(1), got.argmax(1))


def _views(name: str) -> list[bytes]:
    """16 views of a photo: whole, four corner crops and the centre crop at 80%, the centre at 60% and 90%, each
    also mirrored; ImageNet-sized JPEGs."""
    from PIL import ImageOps

    from harness.photos import jpeg

    image = photo(name)
    width, height = image.size
    boxes = [(0.0, 0.0, 1.0)] + [(x, y, 0.8) for x in (0.0, 0.2) for y in (0.0, 0.2)] + [
        (0.1, 0.1, 0.8), (0.2, 0.2, 0.6), (0.05, 0.05, 0.9)]
    crops = [image.crop((int(x * width), int(y * height), int((x + s) * width), int((y + s) * height)))
             for x, y, s in boxes]
    return [jpeg(view, (500, 375)) for crop in crops for view in (crop, ImageOps.mirror(crop))]


def test_drift_rises_when_the_photos_change_from_a_cat_to_coffee(real_weights: Path) -> None:
    # The real Lite0 (no reference in its manifest): its first 16 predictions, views of the cat photo, are the
    # reference. The same views again read 0; half the window turning to coffee reads drifted.
    import base64

    from app.factory import create_app
    from app.config import Settings

    app = create_app(Settings(weights_dir=real_weights, device="cpu", max_batch_size=4, max_wait_ms=5,
                              log_level="warning", warmup=False, monitor_window=16, monitor_min_predictions=16))
    try:
        client = app.test_client()

        def send(images: list[bytes]) -> dict:
            for start in range(0, len(images), 4):
                body = {"images": [base64.b64encode(image).decode() for image in images[start:start + 4]]}
                assert client.post("/predict", json=body).status_code == 200
            return client.get("/v1/models").get_json()["models"][0]["monitoring"]

        cats = _views("chelsea")
        reference = send(cats)["reference"]
        assert (reference["source"], reference["predictions"], reference["complete"]) == ("first_predictions", 16, True)
        same = send(cats)
        assert same["psi"] == pytest.approx(0, abs=1e-9)
        assert {c["index"] for c in same["top_classes"][:1]} <= set(CATS)  # a cat class leads
        changed = send(_views("coffee")[:8])
        assert changed["psi"] > 0.2, changed
        assert any(c["index"] in COFFEE for c in changed["top_classes"]), changed["top_classes"]
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=10)
