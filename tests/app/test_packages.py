"""AOTInductor packages (#21): compiled at export, recorded in the manifest, served where they fit, with the reasons
said when they do not. The compiled tests build a real package of a tiny model (g++; about half a minute)."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import skimage.data
import torch
from PIL import Image

from app import EXTENSION_KEY

from app.factory import create_app
from app.config import Settings
from app.engine.loaded.predictor import Predictor
from models.export.__main__ import package_targets
from models.export.checks import ModelLoadError
from models.export.choose import choose_package, why_not
from models.export.manifest import CompiledPackage, read_manifest, sha256_of, write_manifest
from tests.support.fakes import tiny_manifest

MAX_BATCH = 8


def _package(**changes: object) -> CompiledPackage:
    fields = {"path": "model.cpu-float32.pt2", "sha256": "0" * 64, "device": "cpu", "dtype": "float32",
              "torch_version": torch.__version__, "max_batch_size": 64, "compile_s": 30.0}
    return CompiledPackage.model_validate(fields | changes)


def test_a_package_serves_only_where_it_fits(caplog: pytest.LogCaptureFixture) -> None:
    cpu = torch.device("cpu")
    assert why_not(_package(), cpu, "float32", 64) is None
    assert why_not(_package(device="cuda"), cpu, "float32", 8) == "compiled for cuda, this server runs on cpu"
    assert why_not(_package(dtype="bfloat16"), cpu, "float32", 8) == ("compiled for bfloat16, this server "
                                                                     "computes in float32")
    assert "compiled by torch 2.0.0" in why_not(_package(torch_version="2.0.0"), cpu, "float32", 8)
    assert why_not(_package(max_batch_size=4), cpu, "float32", 8) == (
        "compiled for batches up to 4, this server batches up to 8 (MAX_BATCH_SIZE, or its automatic value for the "
        "device)")
    manifest = tiny_manifest().model_copy(update={"packages": [_package(torch_version="2.0.0")]})
    with pytest.raises(ModelLoadError, match="WEIGHTS_FORMAT=aoti but no AOTInductor package fits: "
                                             "model.cpu-float32.pt2: compiled by torch 2.0.0"):
        choose_package(manifest, "aoti", cpu, "float32", 8)
    fitting = tiny_manifest().model_copy(update={"packages": [_package(device="cuda"), _package()]})
    assert choose_package(fitting, "aoti", cpu, "float32", 8).device == "cpu"
    assert choose_package(fitting, "torchscript", cpu, "float32", 8) is None
    assert choose_package(fitting, "auto", cpu, "float32", 8) is None  # the CPU's fastest is ONNX, not a package
    on_gpu = tiny_manifest().model_copy(update={"packages": [_package(device="cuda", dtype="float16")]})
    with caplog.at_level(logging.INFO, logger="models.export.choose"):
        assert choose_package(on_gpu, "auto", torch.device("cuda"), "float16", 8) is None  # not measured there
    assert "serving TorchScript: no AOTInductor package (float or int8) was measured faster on cuda" in caplog.text


def test_auto_serves_a_fitting_package_where_packages_are_faster(monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr("models.export.choose.FASTEST_ON", {"cpu": "aoti"})  # as a measurement would set it
    cpu = torch.device("cpu")
    fitting = tiny_manifest().model_copy(update={"packages": [_package()]})
    assert choose_package(fitting, "auto", cpu, "float32", 8) is not None
    stale = tiny_manifest().model_copy(update={"packages": [_package(torch_version="2.0.0")]})
    with caplog.at_level(logging.INFO, logger="models.export.choose"):
        assert choose_package(stale, "auto", cpu, "float32", 8) is None
    assert "no AOTInductor package fits (model.cpu-float32.pt2: compiled by torch 2.0.0" in caplog.text


def test_the_export_command_reads_its_package_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    # As on a machine with a GPU and g++: without, cuda (and any package without g++) is refused, before anything
    # is written (tests/training/test_export_writes.py).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("models.export.compile.shutil.which", lambda name: f"/usr/bin/{name}")
    assert package_targets("none", "float16") == []
    assert package_targets("onnx,cpu", "float16") == [("onnx", "float32"), ("cpu", "float32")]
    assert package_targets("cpu", "float16") == [("cpu", "float32")]
    assert package_targets("cpu,cuda", "bfloat16") == [("cpu", "float32"), ("cuda", "bfloat16")]
    assert package_targets("cpu,cpu-int8", "float32") == [("cpu", "float32"), ("cpu", "int8")]


def test_int8_targets_need_torchao_and_say_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("models.export.__main__.importlib.util.find_spec", lambda name: None)
    with pytest.raises(ValueError, match="int8 packages are quantized with torchao: .* -m pip install torchao"):
        package_targets("cpu,cpu-int8", "float32")
    with pytest.raises(ValueError, match="--packages takes onnx, cpu, cuda"):
        package_targets("tpu", "float32")


@pytest.fixture(scope="module")
def packaged_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model exported with a CPU package for batches of 1 to MAX_BATCH (really compiled)."""
    from models.export.write import export_model
    from models.presets import EvalPreset
    from models.architectures import build_model

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("packaged")
    export_model(build_model("mobilenet_v3_small", 3).eval(), out_dir=out, name="mine", version="1",
                 arch="mobilenet_v3_small", labels=["a", "b", "c"], preset=EvalPreset(resize_size=72, crop_size=64),
                 packages=[("cpu", "float32")], package_max_batch=MAX_BATCH)
    return out


def test_the_manifest_records_the_package(packaged_export: Path) -> None:
    (package,) = read_manifest(packaged_export).packages
    assert package.path == "model.cpu-float32.pt2" and package.sha256 == sha256_of(packaged_export / package.path)
    assert (package.device, package.dtype, package.torch_version) == ("cpu", "float32", torch.__version__)
    assert package.max_batch_size == MAX_BATCH and package.compile_s > 0


def _photos(preprocess: object, count: int) -> torch.Tensor:
    names = ["chelsea", "coffee", "astronaut", "rocket", "immunohistochemistry", "coins", "retina",
             "hubble_deep_field"]
    images = [Image.fromarray(np.asarray(getattr(skimage.data, name)())).convert("RGB") for name in names]
    return torch.stack([preprocess(images[i % len(images)]) for i in range(count)])  # type: ignore[operator]


def test_the_package_answers_as_the_eager_model_at_every_batch_size(packaged_export: Path) -> None:
    package = Predictor.load(packaged_export, weights_format="aoti", device="cpu", max_batch_size=MAX_BATCH)
    eager = Predictor.load(packaged_export, weights_format="state_dict", device="cpu")
    assert package.weights_format == "aoti"
    photos = _photos(eager.transform, MAX_BATCH)
    for size in range(1, MAX_BATCH + 1):
        difference = (package.predict_batch(photos[:size]) - eager.predict_batch(photos[:size])).abs().max()
        assert float(difference) < 1e-4, (size, float(difference))


def served_format(weights: Path, fmt: str, max_batch: int) -> str:
    """The format the app built with WEIGHTS_FORMAT=fmt serves, as /v1/models says."""
    app = create_app(Settings(weights_dir=weights, device="cpu", max_batch_size=max_batch, log_level="warning",
                              weights_format=fmt))
    try:
        (info,) = app.test_client().get("/v1/models").get_json()["models"]
        return info["format"]
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=10)


def test_the_server_serves_the_package_when_asked_and_refuses_one_that_does_not_fit(packaged_export: Path,
                                                                                     tmp_path: Path) -> None:
    assert served_format(packaged_export, "aoti", MAX_BATCH) == "aoti"
    assert served_format(packaged_export, "auto", MAX_BATCH) == "torchscript"
    with pytest.raises(ModelLoadError, match="compiled for batches up to 8, this server batches up to 16"):
        Predictor.load(packaged_export, weights_format="aoti", device="cpu", max_batch_size=MAX_BATCH * 2)
    corrupt = shutil.copytree(packaged_export, tmp_path / "corrupt")
    (corrupt / "model.cpu-float32.pt2").write_bytes(b"not a package")
    with pytest.raises(ModelLoadError, match="package .* has sha256"):
        Predictor.load(corrupt, weights_format="aoti", device="cpu", max_batch_size=MAX_BATCH)
    manifest = read_manifest(corrupt)
    write_manifest(corrupt, manifest.model_copy(update={"packages": [
        manifest.packages[0].model_copy(update={"torch_version": "2.0.0"})]}))
    with pytest.raises(ModelLoadError, match="compiled by torch 2.0.0"):
        Predictor.load(corrupt, weights_format="aoti", device="cpu", max_batch_size=MAX_BATCH)
