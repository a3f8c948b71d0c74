"""The ONNX file (#32): written and checked against the model at export, served by ONNX Runtime on the CPU under
WEIGHTS_FORMAT=onnx, and by auto there when its answers agreed; refused with a reason where it cannot serve."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from app import EXTENSION_KEY
from app.config import Settings
from app.engine.loaded.predictor import Predictor
from app.factory import create_app
from models.export.checks import ModelLoadError
from models.export.choose import choose_onnx
from models.export.manifest import Agreement, Manifest, OnnxFile, read_manifest, sha256_of
from tests.app.test_packages import served_format
from tests.support.fakes import export_tiny, tiny_manifest

CPU = torch.device("cpu")


def _with_onnx(top1: float = 1.0, cosine: float | None = None, difference: float = 0.0) -> Manifest:
    onnx = OnnxFile(path="model.onnx", sha256="0" * 64, opset=18, max_batch_size=64, torch_version="x",
                    export_s=7.0, agreement=Agreement(photos=198, top1=top1, max_probability_difference=difference,
                                                      min_embedding_cosine=cosine))
    return tiny_manifest().model_copy(update={"onnx": onnx})


@pytest.fixture(scope="module")
def onnx_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny mobilenet exported with its ONNX file (really exported and checked: seconds)."""
    return export_tiny(tmp_path_factory.mktemp("onnx"), packages=(("onnx", "float32"),))


def test_auto_serves_onnx_on_the_cpu_only_when_it_agreed(caplog: pytest.LogCaptureFixture) -> None:
    assert choose_onnx(_with_onnx(), "auto", CPU, "float32").path == "model.onnx"
    assert choose_onnx(_with_onnx(), "torchscript", CPU, "float32") is None  # asked for another format
    assert choose_onnx(_with_onnx(), "auto", torch.device("cuda"), "float16") is None  # not measured on a GPU
    with caplog.at_level(logging.INFO, logger="models.export.choose"):
        assert choose_onnx(tiny_manifest(), "auto", CPU, "float32") is None  # an export from before ONNX
        assert choose_onnx(_with_onnx(top1=0.97), "auto", CPU, "float32") is None
        assert choose_onnx(_with_onnx(cosine=0.95), "auto", CPU, "float32") is None  # its embeddings differ
    assert choose_onnx(_with_onnx(cosine=0.9999), "auto", CPU, "float32").path == "model.onnx"
    with caplog.at_level(logging.INFO, logger="models.export.choose"):  # float32 as the model: rounding apart only
        assert choose_onnx(_with_onnx(difference=0.4), "auto", CPU, "float32") is None
    assert choose_onnx(_with_onnx(difference=2e-6), "auto", CPU, "float32").path == "model.onnx"
    assert "its probabilities differ from the model's by up to 4.0e-01, beyond 0.001" in caplog.text
    assert "not serving ONNX: the manifest lists no ONNX file" in caplog.text
    assert "its top-1 agrees with float32 on 97.0% of 198 photos" in caplog.text
    assert "its embeddings' cosine with float32's fell to 0.950, below 0.99" in caplog.text


@pytest.mark.parametrize(("manifest", "device", "dtype", "reason"), [
    (tiny_manifest(), "cpu", "float32", "the manifest lists no ONNX file"),
    (_with_onnx(), "cuda", "float16", "ONNX Runtime serves on the CPU here, this server runs on cuda"),
    (_with_onnx(), "cpu", "bfloat16", "the ONNX file computes in float32, this server computes in bfloat16"),
])
def test_weights_format_onnx_refuses_to_start_saying_why(manifest: Manifest, device: str, dtype: str,
                                                         reason: str) -> None:
    with pytest.raises(ModelLoadError, match=f"WEIGHTS_FORMAT=onnx but {reason}"):
        choose_onnx(manifest, "onnx", torch.device(device), dtype)


def test_the_export_command_a_refusal_names_runs_in_a_fresh_shell() -> None:
    # Before: "python -m models.export --packages onnx writes one": a fresh shell's python has no torch
    from models.commands import python_command

    with pytest.raises(ModelLoadError) as refused:
        choose_onnx(tiny_manifest(), "onnx", CPU, "float32")
    assert f"({python_command()} -m models.export --packages onnx writes one)" in str(refused.value)


def test_weights_format_onnx_with_a_file_that_did_not_agree_says_so() -> None:
    # Before: logged, then None, and the load looked for a weights file named "onnx": "the manifest lists no onnx
    # file (has: torchscript, state_dict)", though it lists one
    with pytest.raises(ModelLoadError, match="WEIGHTS_FORMAT=onnx but its top-1 agrees with float32 on 50.0%"):
        choose_onnx(_with_onnx(top1=0.5), "onnx", CPU, "float32")


def test_the_export_writes_the_onnx_file_with_its_agreement(onnx_export: Path) -> None:
    manifest = read_manifest(onnx_export)
    assert manifest.onnx is not None and manifest.onnx.sha256 == sha256_of(onnx_export / "model.onnx")
    assert manifest.onnx.agreement.photos == 198 and manifest.onnx.agreement.top1 == 1.0
    assert manifest.onnx.agreement.max_probability_difference < 1e-4
    assert manifest.embedding.dim == 1024 and manifest.onnx.agreement.min_embedding_cosine > 0.9999
    assert manifest.default_format == "torchscript"  # what a server without ONNX Runtime's choice falls back to


def test_onnx_answers_as_the_eager_model_at_every_batch_size(onnx_export: Path) -> None:
    onnx = Predictor.load(onnx_export, device="cpu")  # auto on the CPU
    eager = Predictor.load(onnx_export, weights_format="state_dict", device="cpu")
    assert onnx.weights_format == "onnx" and onnx.weights_bytes == (onnx_export / "model.onnx").stat().st_size
    torch.manual_seed(1)
    photos = torch.rand(8, 3, 32, 32)
    for size in (1, 3, 8):  # the probabilities, and the embedding after them, from one forward pass
        answered = onnx.predict_batch(photos[:size])
        assert answered.shape == (size, 3 + 1024)
        assert float((answered - eager.predict_batch(photos[:size])).abs().max()) < 1e-5


def test_a_changed_onnx_file_stops_the_load(onnx_export: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in onnx_export.iterdir():
        copy.joinpath(path.name).write_bytes(path.read_bytes())
    (copy / "model.onnx").write_bytes((copy / "model.onnx").read_bytes()[:-10])
    with pytest.raises(ModelLoadError, match="model.onnx has sha256"):
        Predictor.load(copy, weights_format="onnx", device="cpu")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["onnx"]["sha256"] = sha256_of(copy / "model.onnx")
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelLoadError, match="cannot load ONNX file"):
        Predictor.load(copy, weights_format="onnx", device="cpu")


def test_the_server_serves_onnx_by_default_on_the_cpu(onnx_export: Path) -> None:
    assert served_format(onnx_export, "auto", 4) == "onnx"
    assert served_format(onnx_export, "torchscript", 4) == "torchscript"


@pytest.mark.parametrize(("weights_format", "platform"), [("auto", "onnxruntime_onnx"),
                                                         ("torchscript", "pytorch_libtorch")])
def test_the_v2_metadata_names_the_runtime_the_version_runs_on(onnx_export: Path, settings: Settings,
                                                               weights_format: str, platform: str) -> None:
    # Before: the platform was always "pytorch", where ONNX Runtime (the CPU's automatic choice) ran the version
    app = create_app(settings.model_copy(update={"weights_dir": onnx_export, "weights_format": weights_format,
                                                 "warmup": False}))
    try:
        client = app.test_client()
        served = client.get("/v1/models").get_json()["models"][0]
        assert served["format"] == ("onnx" if weights_format == "auto" else weights_format)
        assert client.get(f"/v2/models/{served['name']}").get_json()["platform"] == platform
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_a_model_the_exporter_cannot_take_is_exported_without_onnx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    def unsupported(*_: object) -> None:
        raise RuntimeError("no ONNX op for aten::something_new")

    monkeypatch.setattr("models.export.onnx._write", unsupported)
    with caplog.at_level(logging.WARNING, logger="models.export.onnx"):
        export_tiny(tmp_path, packages=(("onnx", "float32"),), copied=False)  # the patched exporter runs
    assert read_manifest(tmp_path).onnx is None and not (tmp_path / "model.onnx").exists()
    assert "no ONNX file (the server will serve TorchScript): the export failed: no ONNX op" in caplog.text
    assert Predictor.load(tmp_path, device="cpu").weights_format == "torchscript"


@pytest.mark.slow  # a second or more (a run of the CLI, make, or workers sharing a state): the full suite's
def test_an_onnx_file_whose_probabilities_differ_is_not_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    # Only top-1 and the embeddings' cosine were checked: ONNX answers at another scale (the same top class, every
    # probability off) were written, and auto served them on the CPU.
    import models.export.onnx as onnx

    real = onnx.run_session

    def surer(runner: object, batch: object) -> object:  # each row's top class by 1 more: the same class, surer
        answered = real(runner, batch)  # type: ignore[arg-type]
        logits = answered[0] if isinstance(answered, tuple) else answered
        top = logits.float().softmax(dim=1).argmax(dim=1)  # as the agreement reads it (the tiny model's are ties)
        logits = logits + torch.nn.functional.one_hot(top, logits.shape[1])
        return (logits, *answered[1:]) if isinstance(answered, tuple) else logits

    monkeypatch.setattr(onnx, "run_session", surer)
    with caplog.at_level(logging.WARNING, logger="models.export.onnx"):
        export_tiny(tmp_path, packages=(("onnx", "float32"),), copied=False)  # the patched exporter runs
    assert read_manifest(tmp_path).onnx is None and not (tmp_path / "model.onnx").exists()
    assert "no ONNX file (the server will serve TorchScript): its probabilities differ" in caplog.text


@pytest.mark.slow  # the ONNX exporter runs: seconds
def test_an_export_without_the_agreement_photos_says_which_package_to_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # The image installed requirements.txt only, without scikit-image: its build exported TorchScript alone, said
    # "No module named 'skimage'" and nothing of what to do (scikit-image is in requirements.txt now)
    def no_skimage(*_: object) -> None:
        raise ModuleNotFoundError("No module named 'skimage'", name="skimage")

    monkeypatch.setattr("models.export.agreement._photo", no_skimage)
    with caplog.at_level(logging.WARNING, logger="models.export.onnx"):
        export_tiny(tmp_path, packages=(("onnx", "float32"),), copied=False)  # the patched exporter runs
    assert read_manifest(tmp_path).onnx is None
    assert "skimage is not installed: " in caplog.text and " -m pip install -r requirements.txt" in caplog.text


def test_the_load_s_log_line_names_the_onnx_file_s_whole_path(onnx_export: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    # Before: "(ONNX Runtime, model.onnx)", the name alone, where the other formats' lines give the whole path
    # (an operator looked for which folder served; a trial)
    with caplog.at_level(logging.INFO, logger="models.export.load"):
        Predictor.load(onnx_export, weights_format="onnx", device="cpu")
    assert f"loaded mine 1 (onnx) from {onnx_export / 'model.onnx'} onto cpu, under ONNX Runtime" in caplog.text


def test_v1_models_gives_the_checksum_of_the_onnx_file_it_serves(onnx_export: Path) -> None:
    # Before: "files" named the TorchScript and state-dict files only, not the ONNX file that served (format: onnx)
    from app.v1.routes import _file_checksums

    manifest = read_manifest(onnx_export)
    assert _file_checksums(manifest) == {**{fmt: f.sha256 for fmt, f in manifest.files.items()},
                                         "onnx": sha256_of(onnx_export / "model.onnx")}
