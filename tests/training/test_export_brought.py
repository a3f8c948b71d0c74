"""``python -m models.export --state-dict`` / ``--torchscript``: a model trained elsewhere, with its labels and how its
pictures were prepared, exported as the server serves it (before: no command took one; a user wrote manifest.json by
hand from the source, sha256s and all), and every mistake refused in one line saying what to give instead."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torchvision

from app.config import Settings
from app.engine.decoding.tensor import image_to_tensor_path
from app.engine.loaded.predictor import Predictor
from models.architectures import build_model
from models.export.__main__ import main
from models.export.checks import ModelLoadError
from models.export.manifest import read_manifest
from models.image_decode import DecodeLimits
from tests.support.imaging import RED, image_bytes

LABELS = ["daisy", "rose", "tulip"]


def export(argv: list[str], caplog: pytest.LogCaptureFixture) -> tuple[int, list[str]]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="models.export"):
        code = main(argv)
    return code, [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.fixture
def labels(tmp_path: Path) -> Path:
    path = tmp_path / "labels.txt"
    path.write_text("\n".join(LABELS) + "\n\n")  # a blank line at the end, as editors leave one
    return path


def _served_equals_own(out: Path, own: torch.nn.Module) -> Predictor:
    """The export as the server loads it answers as ``own`` does on the pixels it prepares from a photo."""
    server = Predictor.load(out, device="cpu")
    pixels = image_to_tensor_path(image_bytes(RED, size=(96, 80)), server.tensor_transform,
                                  DecodeLimits.from_settings(Settings())).unsqueeze(0)
    with torch.inference_mode():
        expected = own.eval()(pixels).softmax(dim=1)
    assert torch.allclose(server.probabilities(pixels), expected, atol=1e-5)
    return server


@pytest.mark.slow  # real exports: seconds each
def test_a_state_dict_of_a_named_or_a_library_s_architecture_is_exported_and_served_as_trained(
        tmp_path: Path, labels: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = torchvision.models.mobilenet_v3_small(num_classes=3)
    nested = tmp_path / "nested.pt"  # as Lightning and DDP save: {"state_dict": {"module.<key>": ...}}
    torch.save({"state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}, "epoch": 3}, nested)
    out = tmp_path / "out"
    code, errors = export(["--state-dict", str(nested), "--arch", "mobilenet_v3_small", "--labels", str(labels),
                           "--name", "flowers", "--out", str(out), "--crop-size", "96", "--mean", "0.5", "0.5",
                           "0.5", "--std", "0.5", "0.5", "0.5", "--packages", "none"], caplog)
    assert code == 0, errors
    manifest = read_manifest(out)
    assert (manifest.name, manifest.arch, manifest.labels) == ("flowers", "mobilenet_v3_small", LABELS)
    preset = manifest.preprocess  # the resize in torchvision's proportion to the crop given alone
    assert (preset.resize_size, preset.crop_size, preset.mean, preset.std) == (110, 96, (0.5,) * 3, (0.5,) * 3)
    assert sorted(manifest.files) == ["state_dict", "torchscript"] and manifest.embedding is not None
    assert manifest.source == "state dict nested.pt of mobilenet_v3_small"
    _served_equals_own(out, model)
    # any other model of timm's, by its name
    timm_model = build_model("timm:mobilenetv3_small_050", 3)
    torch.save(timm_model.state_dict(), tmp_path / "timm.pt")
    code, errors = export(["--state-dict", str(tmp_path / "timm.pt"), "--arch", "timm:mobilenetv3_small_050",
                           "--labels", str(labels), "--name", "fruit", "--repository", str(tmp_path / "repository"),
                           "--crop-size", "64", "--packages", "none"], caplog)
    assert code == 0, errors
    _served_equals_own(tmp_path / "repository" / "fruit" / "1", timm_model)


@pytest.mark.slow  # real exports: seconds each
def test_a_torchscript_file_is_exported_as_torchscript_alone_and_served_as_trained(
        tmp_path: Path, labels: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = torchvision.models.mobilenet_v3_small(num_classes=3).eval()
    torch.jit.save(torch.jit.script(model), tmp_path / "mine.ts")
    out = tmp_path / "out"
    argv = ["--torchscript", str(tmp_path / "mine.ts"), "--labels", str(labels), "--name", "flowers", "--out",
            str(out), "--crop-size", "96"]
    code, errors = export([*argv, "--packages", "onnx"], caplog)  # no code to build ONNX from
    assert code == 2 and errors == ["error: a TorchScript file is exported as TorchScript alone: give --packages "
                                    "none (ONNX and compiled packages are built from the model's code: --state-dict "
                                    "FILE --arch ARCH)"] and not out.exists()
    code, errors = export(argv, caplog)  # auto: none for a TorchScript file
    assert code == 0, errors
    manifest = read_manifest(out)
    assert list(manifest.files) == ["torchscript"] and manifest.arch == "torchscript" and manifest.onnx is None
    assert _served_equals_own(out, model).weights_format == "torchscript"


def test_what_is_not_what_it_is_said_to_be_is_refused_in_one_line_and_nothing_written(
        tmp_path: Path, labels: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = torchvision.models.mobilenet_v3_small(num_classes=3)
    torch.save(model.state_dict(), tmp_path / "mine.pt")
    torch.save(model, tmp_path / "pickled.pt")
    (tmp_path / "five.txt").write_text("a\nb\nc\nd\ne\n")
    (tmp_path / "gap.txt").write_text("a\n\nc\n")
    out = tmp_path / "out"
    common = ["--name", "flowers", "--out", str(out), "--packages", "none"]
    for argv, said in (
            (["--state-dict", str(tmp_path / "mine.pt"), "--labels", str(labels), "--arch", "resnet18"],
             f"{tmp_path / 'mine.pt'} is no state dict of resnet18 with 3 classes (one a label): "),
            (["--state-dict", str(tmp_path / "mine.pt"), "--labels", str(tmp_path / "five.txt"), "--arch",
              "mobilenet_v3_small"], "with 5 classes (one a label): 0 of its 244 keys missing, 0 unexpected, 2 of "
                                     "another shape (the head classifier.3.bias: (3,) against (5,)"),
            (["--state-dict", str(tmp_path / "pickled.pt"), "--labels", str(labels), "--arch", "mobilenet_v3_small"],
             "is no state dict torch can read safely (a pickled object, which torch's safe load refuses): save the "
             "weights alone with torch.save(model.state_dict(), path)"),
            (["--torchscript", str(tmp_path / "mine.pt"), "--labels", str(labels)],
             f"{tmp_path / 'mine.pt'} is no TorchScript file (torch.jit.script or torch.jit.trace, then "
             f"torch.jit.save, writes one)"),
            (["--state-dict", str(tmp_path / "mine.pt"), "--labels", str(labels), "--arch", "timm:no_such_model"],
             "unknown arch 'timm:no_such_model': timm has no model 'no_such_model'"),
            (["--state-dict", str(tmp_path / "mine.pt"), "--labels", str(tmp_path / "gap.txt"), "--arch",
              "mobilenet_v3_small"], "labels: labels [1] are empty"),
            (["--state-dict", str(tmp_path / "mine.pt"), "--labels", str(labels), "--arch", "mobilenet_v3_small",
              "--mean", "123.7", "116.3", "103.5"], "(on 0..255: divide them by 255)"),
            (["--state-dict", str(tmp_path / "mine.pt"), "--labels", str(labels)], "--state-dict needs --arch ARCH"),
            (["--torchscript", str(tmp_path / "mine.pt"), "--labels", str(labels), "--arch", "resnet18"],
             "--arch names a --state-dict's architecture; a TorchScript file holds its own code")):
        code, errors = export([*argv, *common], caplog)
        assert code == 2 and len(errors) == 1 and said in errors[0], (argv, errors)
    code, errors = export(["--state-dict", str(tmp_path / "mine.pt"), "--arch", "resnet18"], caplog)
    assert code == 2 and errors == ["error: --state-dict needs --labels FILE, --name NAME, --out DIR or --repository "
                                    "DIR too"]
    assert not out.exists()


def test_the_server_says_so_when_a_state_dict_is_not_its_manifest_s_architecture(tmp_path: Path) -> None:
    # Before: torch's error, every key listed (8,527 characters in one log line); a state dict listed as TorchScript:
    # "PytorchStreamReader failed locating file constants.pkl ... your checkpoint file is corrupted"
    from models.export.load import load_module
    from tests.support.fakes import tiny_manifest

    torch.save(torchvision.models.mobilenet_v3_small(num_classes=4).state_dict(), tmp_path / "weights.pt")
    manifest = tiny_manifest().model_copy(update={"arch": "resnet18"})
    with pytest.raises(ModelLoadError) as refused:
        load_module(tmp_path / "weights.pt", manifest, "state_dict")
    said = str(refused.value)
    assert said.startswith(f"cannot load state_dict weights from {tmp_path / 'weights.pt'}: they are not those of "
                           f"resnet18 with 4 classes: ") and len(said) < 400, said
    with pytest.raises(ModelLoadError, match="is no TorchScript file"):
        load_module(tmp_path / "weights.pt", manifest, "torchscript")
