"""``python -m models.export --state-dict`` / ``--torchscript``: a model trained elsewhere, with its labels and how its
pictures were prepared, exported as the server serves it (before: no command took one; a user wrote manifest.json by
hand from the source, sha256s and all), and every mistake refused in one line saying what to give instead."""
from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
import skimage.data
import torch
from PIL import Image

from app.config import Settings
from app.engine.decoding.tensor import image_to_tensor_path
from app.engine.loaded.predictor import Predictor
from models.architectures import build_model, head_of
from models.export.__main__ import main
from models.export.checks import ModelLoadError
from models.export.manifest import read_manifest
from models.image_decode import DecodeLimits
from tests.support.imaging import encode

LABELS = ["daisy", "rose", "tulip"]


def export(argv: list[str], caplog: pytest.LogCaptureFixture) -> tuple[int, list[str]]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="models.export"):
        code = main(argv)
    return code, [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.fixture(autouse=True)
def seeded() -> None:
    """The models' random weights the same wherever a test runs: a sharpened head magnifies the one level PIL's and
    the server's resizes differ by at some pixels, past the tolerance for 2 of 40 random resnet18s (a test that
    failed by the order its worker ran tests in)."""
    torch.manual_seed(0)


@pytest.fixture
def labels(tmp_path: Path) -> Path:
    path = tmp_path / "labels.txt"
    path.write_text("\n".join(LABELS) + "\n\n")  # a blank line at the end, as editors leave one
    return path


def _sharpened(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its head's weights 50 times larger: an untrained model's answers are near uniform (1/3 each,
    whatever its weights), which a wrong weight or preparation would not change."""
    with torch.no_grad():
        head_of(model).weight.mul_(50)
    return model.eval()


def _served_equals_own(out: Path, own: torch.nn.Module) -> Predictor:
    """The export as the server loads it answers a photo as ``own`` does on the pixels docs/models.md says prepare
    it: torchvision's Resize (antialiased), CenterCrop, ToTensor, Normalize of the manifest's preparation."""
    import torchvision

    server = Predictor.load(out, device="cpu")
    photo = encode(Image.fromarray(skimage.data.chelsea()), "JPEG")  # 451x300, textured
    served = server.probabilities(image_to_tensor_path(photo, server.tensor_transform,
                                                       DecodeLimits.from_settings(Settings())).unsqueeze(0))
    preset, T = server.manifest.preprocess, torchvision.transforms
    prepare = T.Compose([T.Resize(preset.resize_size, interpolation=T.InterpolationMode(preset.interpolation),
                                  antialias=True), T.CenterCrop(preset.crop_size), T.ToTensor(),
                         T.Normalize(preset.mean, preset.std)])
    with torch.inference_mode():
        expected = own.eval()(prepare(Image.open(io.BytesIO(photo)).convert("RGB")).unsqueeze(0)).softmax(dim=1)
    assert float(expected.max() - expected.min()) > 0.05, expected  # no uniform answer: its weights tell
    assert torch.allclose(served, expected, atol=2e-3), (served, expected)
    return server


@pytest.mark.slow  # real exports: seconds each
def test_a_state_dict_of_a_named_or_a_library_s_architecture_is_exported_and_served_as_trained(
        tmp_path: Path, labels: Path, caplog: pytest.LogCaptureFixture) -> None:
    import torchvision

    model = _sharpened(torchvision.models.resnet18(num_classes=3))
    nested = tmp_path / "nested.pt"  # as Lightning saves: {"state_dict": {"<its attribute>.<key>": ...}, ...}
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "epoch": 3}, nested)
    out = tmp_path / "out"
    code, errors = export(["--state-dict", str(nested), "--arch", "resnet18", "--labels", str(labels),
                           "--name", "flowers", "--out", str(out), "--crop-size", "96", "--mean", "0.5", "0.5",
                           "0.5", "--std", "0.5", "0.5", "0.5", "--packages", "none"], caplog)
    assert code == 0, errors
    manifest = read_manifest(out)
    assert (manifest.name, manifest.arch, manifest.labels) == ("flowers", "resnet18", LABELS)
    preset = manifest.preprocess  # the resize in torchvision's proportion to the crop given alone
    assert (preset.resize_size, preset.crop_size, preset.mean, preset.std) == (110, 96, (0.5,) * 3, (0.5,) * 3)
    assert sorted(manifest.files) == ["state_dict", "torchscript"] and manifest.embedding is not None
    assert manifest.source == "state dict nested.pt of resnet18"
    _served_equals_own(out, model)
    # any other model of timm's, by its name
    timm_model = _sharpened(build_model("timm:mobilenetv3_small_050", 3))
    torch.save(timm_model.state_dict(), tmp_path / "timm.pt")
    code, errors = export(["--state-dict", str(tmp_path / "timm.pt"), "--arch", "timm:mobilenetv3_small_050",
                           "--labels", str(labels), "--name", "fruit", "--repository", str(tmp_path / "repository"),
                           "--crop-size", "64", "--packages", "none"], caplog)
    assert code == 0, errors
    _served_equals_own(tmp_path / "repository" / "fruit" / "1", timm_model)


@pytest.mark.slow  # real exports: seconds each
def test_a_torchscript_file_is_exported_as_torchscript_alone_and_served_as_trained(
        tmp_path: Path, labels: Path, caplog: pytest.LogCaptureFixture) -> None:
    import torchvision

    model = _sharpened(torchvision.models.resnet18(num_classes=3))
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
    # scored in bulk with embeddings: none to give, said as what it is (not "written before exports recorded one")
    from models.predict.__main__ import main as predict

    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.jpg").write_bytes(encode(Image.fromarray(skimage.data.chelsea()), "JPEG"))
    caplog.clear()
    assert predict(["--weights", str(out), "--data", str(tmp_path / "photos"), "--out", str(tmp_path / "s.jsonl"),
                    "--embeddings", str(tmp_path / "e.npy")]) == 2
    assert "is a TorchScript file exported alone, with no embedding: export the model's state dict with" in caplog.text


class _LogitsAndFeatures(torch.nn.Module):
    """A classifier answering its features beside its logits, as some trained elsewhere do."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = x.mean((2, 3))
        return self.head(features), features


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_what_is_not_what_it_is_said_to_be_is_refused_in_one_line_and_nothing_written(
        tmp_path: Path, labels: Path, caplog: pytest.LogCaptureFixture) -> None:
    import torchvision

    model = torchvision.models.mobilenet_v3_small(num_classes=3)
    torch.save(model.state_dict(), tmp_path / "mine.pt")
    torch.save({**model.state_dict(), "ema.decay": torch.tensor(0.99)}, tmp_path / "extra.pt")
    torch.save(model, tmp_path / "pickled.pt")
    torch.jit.save(torch.jit.script(model.eval()), tmp_path / "mine.ts")
    torch.jit.save(torch.jit.script(_LogitsAndFeatures()), tmp_path / "pair.ts")
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
              "mobilenet_v3_small"], "gap.txt: line 2 is blank: each line names the class of one of the model's"),
            (["--torchscript", str(tmp_path / "pair.ts"), "--labels", str(labels)],
             "model answers a second output of shape (2, 3) beside its logits: it must answer its logits alone (to "
             "serve embeddings, export its state dict with --arch"),  # (before: "... but the manifest says it has
            # none", of a manifest the export writes itself; a TorchServe user's trial)
            (["--state-dict", str(tmp_path / "mine.pt"), "--labels", str(labels), "--arch", "mobilenet_v3_small",
              "--mean", "123.7", "116.3", "103.5"], "(on 0..255: divide them by 255)"),
            (["--state-dict", str(tmp_path / "mine.pt"), "--labels", str(labels)], "--state-dict needs --arch ARCH"),
            (["--state-dict", str(tmp_path / "extra.pt"), "--labels", str(labels), "--arch", "mobilenet_v3_small"],
             "0 of its 244 keys missing, 1 unexpected, 0 of another shape (keys it has none of: ema.decay)"),
            (["--state-dict", str(tmp_path / "mine.ts"), "--labels", str(labels), "--arch", "mobilenet_v3_small"],
             f"{tmp_path / 'mine.ts'} is a TorchScript file: give it with --torchscript {tmp_path / 'mine.ts'}"),
            (["--state-dict", str(tmp_path / "mine.pt"), "--labels", str(labels), "--arch", "mobilenet_v3_small",
              "--crop-size", "0"], "crop_size: Input should be greater than 0"),  # (before: taken as unsaid, 224)
            (["--torchscript", str(tmp_path / "mine.pt"), "--labels", str(labels), "--arch", "resnet18"],
             "--arch names a --state-dict's architecture; a TorchScript file holds its own code")):
        code, errors = export([*argv, *common], caplog)
        assert code == 2 and len(errors) == 1 and said in errors[0], (argv, errors)
    code, errors = export(["--default", "--labels", str(labels), "--crop-size", "96", *common], caplog)
    assert code == 2 and errors == ["error: --labels, --crop-size describe a model trained elsewhere (--state-dict, "
                                    "--torchscript); the bundled model carries its own"]  # (before: left unread)
    code, errors = export(["--state-dict", str(tmp_path / "mine.pt"), "--arch", "resnet18"], caplog)
    assert code == 2 and errors == ["error: --state-dict needs --labels FILE, --name NAME, --out DIR or --repository "
                                    "DIR too"]
    assert not out.exists()


def test_a_labels_file_is_read_as_editors_write_it(tmp_path: Path) -> None:
    from models.export.brought import read_labels

    (tmp_path / "labels.txt").write_bytes("\ufeffdaisy\r\nwild rose \r\ntulip\r\n\r\n".encode())  # a BOM, CRLF
    assert read_labels(tmp_path / "labels.txt") == ["daisy", "wild rose", "tulip"]  # before: "\ufeffdaisy"
    # a blank line before the last: said as such (before: a count against the model's outputs, one too many; a
    # TorchServe user's trial)
    (tmp_path / "labels.txt").write_text("daisy\n\nwild rose\ntulip\n")
    with pytest.raises(ValueError, match=r"labels.txt: line 2 is blank: each line names the class of one"):
        read_labels(tmp_path / "labels.txt")


def test_a_model_whose_head_cannot_be_taken_out_is_exported_without_an_embedding() -> None:
    # timm's LeViT adds its head's output to another branch's: without the head the forward pass raised, and the
    # export with it (now: exported without an embedding, as a head that is not the last step is)
    from models.architectures import with_embedding

    class Branched(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = torch.nn.Linear(12, 8), torch.nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            features = self.body(x.flatten(1)[:, :12])
            return self.head(features) + features[:, :3]

    with pytest.raises(ValueError, match="is not the last step of its forward pass"):
        with_embedding(Branched(), torch.randn(2, 3, 2, 2))


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_the_server_says_so_when_a_state_dict_is_not_its_manifest_s_architecture(tmp_path: Path) -> None:
    import torchvision

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


def test_a_manifest_whose_label_is_empty_is_refused_naming_it() -> None:
    # (a manifest written by hand: models.export's labels file says its blank line itself)
    import pydantic

    from tests.support.fakes import LABELS, tiny_manifest

    manifest = tiny_manifest().model_dump()
    with pytest.raises(pydantic.ValidationError, match=r"labels \[1\] are empty: each class needs a name"):
        type(tiny_manifest()).model_validate({**manifest, "labels": [LABELS[0], " ", *LABELS[2:]]})


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_what_a_brought_model_s_export_cannot_check_is_warned_of(tmp_path: Path, labels: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    import torchvision

    # Before, each silent (a new user's trial): a final sigmoid (served softmax over it: scores near 1/N), a class
    # named twice, the ImageNet recipe taken for a model given no sizes, a crop larger than its resize.
    class Sigmoid(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x.mean(dim=(2, 3)) * 3, x.std(dim=(2, 3))], dim=1)[:, :3].sigmoid()

    torch.jit.save(torch.jit.script(Sigmoid()), tmp_path / "sigmoid.ts")
    twice = tmp_path / "twice.txt"
    twice.write_text("a\nb\na\n")
    code, _ = export(["--torchscript", str(tmp_path / "sigmoid.ts"), "--labels", str(twice), "--name", "s", "--out",
                      str(tmp_path / "out"), "--resize-size", "32", "--crop-size", "48"], caplog)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert code == 0 and len(warned) == 3, warned
    assert warned[0].endswith("twice.txt names a class more than once ('a' at outputs 0, 2): answers give those "
                              "classes the same label, only their index tells them apart; is that meant?")
    assert warned[1].startswith("--crop-size 48 is larger than --resize-size 32: each image is served padded")
    assert warned[2] == ("every output of sigmoid.ts is between 0 and 1 on the check images (a final sigmoid?): the "
                         "server applies softmax to the outputs, which turns these into near-equal scores (the top "
                         "class kept); export the model without its sigmoid (its logits)")
    model = _sharpened(torchvision.models.resnet18(num_classes=3))
    torch.jit.save(torch.jit.script(model), tmp_path / "logits.ts")
    code, _ = export(["--torchscript", str(tmp_path / "logits.ts"), "--labels", str(labels), "--name", "l", "--out",
                      str(tmp_path / "plain")], caplog)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert code == 0 and len(warned) == 1 and warned[0].startswith("no --resize-size, --crop-size, --mean or --std: "
                                                                    "the export says the model takes torchvision's")
