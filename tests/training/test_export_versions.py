"""What a user meets exporting several models and versions (#31): versions never overwritten, what was written
said in one line, packages compiled only where they are served, the commands' help with their defaults, and the
docs' training and export commands valid as written."""
from __future__ import annotations

import logging
import re
import shlex
from pathlib import Path

import pytest
import torch

from models import train
from models.architectures import ARCHS, build_model
from models.export import __main__ as export_cli
from models.commands import python_command
from models.export.manifest import read_manifest, sha256_of
from models.presets import EvalPreset
from models.run.args import get_args_parser
from models.run.checkpoint import BEST_NAME
from tests.support.fakes import export_tiny
from tests.support.imaging import write_image_folder

NO_PACKAGES = ["--packages", "none"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-epoch run named ``mine`` on the tiny folder."""
    base = tmp_path_factory.mktemp("export")
    data, out = write_image_folder(base / "data"), base / "mine"
    assert train.main(["--data", str(data), "--arch", "mobilenet_v3_small", "--epochs", "1", "--batch-size", "6",
                       "--workers", "0", "--resize-size", "36", "--crop-size", "32", "--device", "cpu",
                       "--output-dir", str(out)]) == 0
    return out


def _export(argv: list[str], caplog: pytest.LogCaptureFixture) -> tuple[int, str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="models.export"):
        code = export_cli.main([*argv, *NO_PACKAGES])
    return code, caplog.text


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_the_default_export_writes_the_version_asked_for_and_never_rewrites_one(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: --default ignored --version and rewrote the newest version (here 1) in place. A 1000-class
    # mobilenet_v3_small stands in for the packaged weights (what is tested is where they go).
    monkeypatch.setattr("models.pretrained.load_lite0_imagenet", lambda: build_model("mobilenet_v3_small", 1000))
    monkeypatch.setattr("models.presets.lite0_preset", lambda: EvalPreset(resize_size=40, crop_size=32))
    repository = tmp_path / "repository"
    first = export_tiny(repository / "efficientnet_lite0" / "1", name="efficientnet_lite0")
    held = sha256_of(first / "manifest.json")
    code, text = _export(["--default", "--repository", str(repository), "--version", "2"], caplog)
    assert code == 0, text
    assert read_manifest(repository / "efficientnet_lite0" / "2").version == "2"
    assert sha256_of(first / "manifest.json") == held  # version 1 untouched
    assert (f"wrote model efficientnet_lite0 version 2 (1000 classes) in {repository / 'efficientnet_lite0' / '2'}: "
            f"torchscript, state_dict") in text
    code, text = _export(["--default", "--repository", str(repository), "--version", "1"], caplog)
    assert code == 2
    (line,) = [line for line in text.splitlines() if "ERROR" in line]
    assert "already holds efficientnet_lite0 1: leave --version out for the next number (3), or pass --force" in line
    # --name: the bundled model as a second model of the repository (before: ignored, written as efficientnet_lite0 3)
    code, text = _export(["--default", "--repository", str(repository), "--name", "other"], caplog)
    assert code == 0, text
    assert read_manifest(repository / "other" / "1").name == "other"
    assert not (repository / "efficientnet_lite0" / "3").exists()


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_a_checkpoint_export_never_replaces_an_export_unless_forced(run: Path, tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    best, repository, out = str(run / BEST_NAME), tmp_path / "repository", tmp_path / "out"
    for expected in ("1", "2"):
        code, text = _export(["--checkpoint", best, "--repository", str(repository)], caplog)
        assert code == 0 and f"wrote model mine version {expected} (3 classes, val top-1 " in text
    code, text = _export(["--checkpoint", best, "--repository", str(repository), "--version", "2"], caplog)
    assert code == 2 and "already holds mine 2: leave --version out for the next number (3)" in text
    assert _export(["--checkpoint", best, "--repository", str(repository), "--version", "2", "--force"],
                   caplog)[0] == 0
    # --out: the same checkpoint again is refused too (before: silently rewritten), --force replaces.
    assert _export(["--checkpoint", best, "--out", str(out), "--version", "1"], caplog)[0] == 0
    code, text = _export(["--checkpoint", best, "--out", str(out), "--version", "1"], caplog)
    assert code == 2 and f"{out} already holds mine 1: export into a new directory" in text
    code, text = _export(["--checkpoint", best, "--out", str(out), "--version", "2", "--force"], caplog)
    assert code == 0 and f"wrote model mine version 2 (3 classes" in text and f"in {out}: torchscript" in text
    # The project's own models/ package is no repository (python -m models.* would import from it).
    package = tmp_path / "models"
    package.mkdir()
    (package / "__init__.py").write_text("")
    code, text = _export(["--checkpoint", best, "--repository", str(package)], caplog)
    assert code == 2 and "is a Python package" in text and not (package / "mine").exists()
    # Nor a single export's folder (before: its manifest and model files written among the code), nor a training
    # folder's (among its class folders of images).
    code, text = _export(["--checkpoint", best, "--out", str(package)], caplog)
    assert code == 2 and f"{package} holds Python code (__init__.py), not an export" in text
    assert not (package / "manifest.json").exists()
    data = tmp_path / "data"
    (data / "cat").mkdir(parents=True)
    (data / "cat" / "1.JPG").write_bytes(b"")
    code, text = _export(["--checkpoint", best, "--out", str(data)], caplog)
    assert code == 2 and f"{data} holds images (cat/1.JPG), not an export" in text


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_a_checkpoint_from_before_the_reference_exports_without_one(run: Path, tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    state = torch.load(run / BEST_NAME, map_location="cpu", weights_only=True)
    assert state["prediction_reference"]["predictions"] == 9  # the tiny folder's validation split
    code, text = _export(["--checkpoint", str(run / BEST_NAME), "--out", str(tmp_path / "new")], caplog)
    assert code == 0, text
    assert read_manifest(tmp_path / "new").reference.class_counts == state["prediction_reference"]["class_counts"]
    del state["prediction_reference"]
    torch.save(state, tmp_path / "old.pt")
    code, text = _export(["--checkpoint", str(tmp_path / "old.pt"), "--out", str(tmp_path / "old")], caplog)
    assert code == 0, text
    assert read_manifest(tmp_path / "old").reference is None


def test_packages_are_compiled_by_default_only_where_they_are_served(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: auto compiled a CPU package (about 30 s), which the server's auto never serves on a CPU; it serves
    # the ONNX file there (#32), which auto writes everywhere (seconds).
    onnx = ("onnx", "float32")
    monkeypatch.setattr(export_cli.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert export_cli.package_targets("auto", "float16") == [onnx]
    assert export_cli.package_targets("cpu", "float16") == [("cpu", "float32")]  # asked for: compiled
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert export_cli.package_targets("auto", "float16") == [onnx, ("cuda", "float16")]
    monkeypatch.setattr(export_cli.shutil, "which", lambda name: None)
    assert export_cli.package_targets("auto", "float16") == [onnx]  # no compiler: no package, said in a warning


def test_help_names_the_commands_and_shows_the_defaults() -> None:
    export_help = " ".join(export_cli.get_args_parser().format_help().split())
    assert export_help.startswith(f"usage: {python_command()} -m models.export")  # .venv/bin/python after install
    assert "(default: auto)" in export_help and "(default: float32)" in export_help
    train_help = " ".join(get_args_parser(ARCHS).format_help().split())
    assert train_help.startswith(f"usage: {python_command()} -m models.train")
    for default in ("(default: 10)", "(default: 32)", "(default: runs/default, or with --resume of a run's "
                    "checkpoint.pt that run's folder)", "(default: 0.9)"):
        assert default in train_help
    assert "(default: None)" not in train_help + export_help and "(default: False)" not in train_help


def test_pretrained_alone_picks_the_arch_it_exists_for() -> None:
    # Before: --pretrained without --arch meant resnet18, for which no packaged weights exist.
    assert get_args_parser(ARCHS).parse_args(["--data", "d", "--pretrained"]).arch == "efficientnet_lite0"
    assert get_args_parser(ARCHS).parse_args(["--data", "d"]).arch == "resnet18"


def _documented(module: str) -> list[tuple[str, list[str]]]:
    """Every ``python -m <module>`` command of the bash blocks in docs/training.md and docs/models.md."""
    found = []
    for doc in ("training.md", "models.md"):
        text = (ROOT / "docs" / doc).read_text(encoding="utf-8")
        for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
            for command in block.replace("\\\n", " ").splitlines():
                if f"-m {module} " in command:
                    words = shlex.split(command, comments=True)
                    found.append((doc, words[words.index(module) + 1:]))
    return found


def test_the_documented_training_and_export_commands_are_valid_as_written() -> None:
    # Before: models.md trained with --pretrained but no --arch (refused), wrote version 2 of `mine` as a new model
    # `mine-2` (no --name), and used a repository folder named models, the project's own package.
    trains, exports = _documented("models.train"), _documented("models.export")
    assert len(trains) >= 4 and len(exports) >= 2
    for doc, argv in trains:
        args = get_args_parser(ARCHS).parse_args(argv)
        assert not args.pretrained or args.arch == "efficientnet_lite0", (doc, argv)
        assert args.export_repository != Path("models"), (doc, argv)
        if args.export_repository and args.output_dir.name != "mine":
            assert args.name, f"{doc}: {argv} writes a new model {args.output_dir.name}, not a version of mine"
    for doc, argv in exports:
        args = export_cli.get_args_parser().parse_args(argv)
        assert args.repository != Path("models"), (doc, argv)


# -- what the load and the export refuse, each with one line ----------------------------------------------------------

class Means(torch.nn.Module):
    """Logits of 4 classes from an image's channel means: a model the server serves."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        means = x.mean(dim=(2, 3))
        return torch.cat([means, means.sum(dim=1, keepdim=True)], dim=1) * 10


class Softmaxed(Means):
    """An export that ends in its own softmax: the server's would be a second one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).softmax(dim=1)


class FirstRowOnly(Means):
    """A batch of any size answered with one row (a reshape to batch 1 traced in)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[:1]


class FixedBatch(torch.nn.Module):
    """A model whose trace fixed its batch at 1 (its flatten a reshape to one row): a batch of 2 raises in its head,
    as ONNX Runtime raises for an ONNX file exported without a dynamic batch dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(3 * 8 * 8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.reshape(1, -1))


class FixedAtTwo(Means):
    """A batch of 2 answered right, any other batch reshaped into 2 rows (a reshape to the batch it was made on):
    before, it passed the export and failed the server's warm-up at batch 1 with a traceback (a new user's trial)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).reshape(2, -1)


class Grey(torch.nn.Module):
    """A one-channel model in a three-channel export: its forward pass raises on the served input."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).mean(dim=(2, 3))


class Answers(Means):
    """Logits in a dict: no tensor where the server wants one."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {"logits": super().forward(x)}


def scripted_export(folder: Path, model: torch.nn.Module, labels: tuple[str, ...] = ("r", "g", "b", "sum"),
                    name: str = "tiny", version: str = "1") -> Path:
    """``model`` traced at batch 1 on 8x8 inputs into ``folder`` as a TorchScript export (manifest and all)."""
    from models.export.manifest import Manifest, WeightsFile, write_manifest

    folder.mkdir(parents=True, exist_ok=True)
    input_channels = 1 if isinstance(model, Grey) else 3
    traced = torch.jit.trace(model.eval(), torch.zeros(1, input_channels, 8, 8), strict=False)
    torch.jit.save(traced, str(folder / "model.torchscript.pt"))
    write_manifest(folder, Manifest.model_construct(  # unvalidated: a manifest written by hand may hold anything
        schema_version=1, name=name, version=version, arch="resnet18", labels=list(labels),
        preprocess=EvalPreset(resize_size=8, crop_size=8), default_format="torchscript", packages=[], onnx=None,
        metrics={}, source="", reference=None, embedding=None,
        files={"torchscript": WeightsFile(path="model.torchscript.pt",
                                          sha256=sha256_of(folder / "model.torchscript.pt"))}))
    return folder


@pytest.mark.parametrize("model, fragment", [
    (Softmaxed(), "the model's output rows are already probabilities (each non-negative and summing to 1 on 4 "
                  "different images): the server applies softmax to them, which would be a second one; export the "
                  "model without its final softmax"),
    (FirstRowOnly(), "model answers 1 rows for a batch of 2 images: it must answer one row per image"),
    (Grey(), "the model fails on a batch of 2 images of shape (3, 8, 8) (torch.float32): RuntimeError: Given "
             "groups=1, weight of size [4, 1, 1, 1], expected input[2, 3, 8, 8] to have 1 channels, but got 3 "
             "channels instead (it takes 1 channels; the server sends RGB, 3: wrap it to take them"),
    (Answers(), "the model answers a dict where a tensor of logits (or logits and an embedding) was expected"),
    (FixedBatch(), "the model runs on one image but fails on a batch of 2: its batch dimension is fixed at 1; export "
                   "it with a dynamic one (torch.onnx.export's dynamic_axes or dynamic_shapes; torch.jit.script "
                   "rather than a trace of one image) (RuntimeError: "),
    (FixedAtTwo(), "model answers shape (2, 2) for one image, where a batch of 2 had one row each: it must answer "
                   "one row per image"),
], ids=["softmax", "one-row", "raises", "dict", "fixed-batch", "fixed-at-two"])
def test_the_load_refuses_a_model_it_could_not_serve_in_one_line(tmp_path: Path, model: torch.nn.Module,
                                                                 fragment: str) -> None:
    # Before: a model ending in softmax served probabilities of probabilities, one answering a row per batch loaded
    # and then failed every batch of 2 or more, and a model that raised escaped as RuntimeError/AttributeError.
    from models.export.checks import ModelLoadError
    from models.export.load import load_model

    with pytest.raises(ModelLoadError) as refused:
        load_model(scripted_export(tmp_path / "export", model), weights_format="torchscript", device="cpu")
    assert fragment in str(refused.value) and "\n" not in str(refused.value)


def test_a_model_of_logits_loads_whatever_they_look_like(tmp_path: Path) -> None:
    from models.export.load import load_model

    class NonNegative(Means):  # logits >= 0 that do not sum to 1: no probabilities
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x).abs()

    for model in (Means(), NonNegative()):
        assert load_model(scripted_export(tmp_path / type(model).__name__, model), device="cpu").manifest.name == "tiny"


def test_models_predict_says_why_a_model_cannot_load_in_one_line_and_exits_2(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from models.predict.__main__ import main as predict_main
    from tests.support.imaging import RED, image_bytes

    weights = scripted_export(tmp_path / "grey", Grey())
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "red.jpg").write_bytes(image_bytes(RED))
    with caplog.at_level(logging.ERROR, logger="models.predict"):
        code = predict_main(["--weights", str(weights), "--data", str(tmp_path / "photos"), "--out",
                             str(tmp_path / "scores.jsonl"), "--device", "cpu", "--workers", "0"])
    errors = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    assert code == 2 and len(errors) == 1 and "\n" not in errors[0]
    assert errors[0].startswith("error: the model fails on a batch of 2 images") and "to have 1 channels" in errors[0]


def test_a_one_class_model_is_refused_by_the_manifest_the_export_and_the_server(tmp_path: Path) -> None:
    # Before: a one-class model loaded and answered 1.0 for every image.
    from app.engine.loaded.predictor import Predictor
    from models.export.checks import ModelLoadError, read_checked_manifest
    from models.export.write import export_model

    wanted = "a classifier needs at least 2 labels, got 1 (['cat'])"
    with pytest.raises(ModelLoadError, match=re.escape(wanted)):
        read_checked_manifest(scripted_export(tmp_path / "one", Means(), labels=("cat",)))
    with pytest.raises(ValueError, match=re.escape(wanted)):
        export_model(Means(), out_dir=tmp_path / "out", name="cat", version="1", arch="resnet18", labels=["cat"],
                     preset=EvalPreset(resize_size=8, crop_size=8))
    assert not (tmp_path / "out").exists()
    manifest = read_manifest(scripted_export(tmp_path / "two", Means()))
    with pytest.raises(ModelLoadError, match=re.escape(wanted)):  # a manifest made in code skips its validation
        Predictor(Means(), manifest.model_copy(update={"labels": ["cat"]}), device="cpu")


class NanWhereBright(Means):
    """Weights a diverged run left: NaN for the images whose red mean is above zero, numbers for the others."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        return torch.where(x[:, :1].mean(dim=(2, 3)) > 0, torch.full_like(logits, float("nan")), logits)


def test_the_export_refuses_a_model_answering_nan_saying_so_and_writes_nothing(tmp_path: Path,
                                                                              caplog: pytest.LogCaptureFixture) -> None:
    # Before: "exported without an embedding: ... is not the last step of its forward pass", then "TorchScript
    # output differs from eager by nan" (a rollout trial's broken version)
    from models.export.checks import ModelLoadError
    from models.export.write import export_model

    with caplog.at_level(logging.WARNING), pytest.raises(ModelLoadError, match=re.escape(
            "the model's output is not finite (NaN or infinity) for ") + "1 of 2 check images: its weights are broken"):
        export_model(NanWhereBright(), out_dir=tmp_path / "out", name="nan", version="1", arch="resnet18",
                     labels=["r", "g", "b", "sum"], preset=EvalPreset(resize_size=8, crop_size=8))
    assert not (tmp_path / "out").exists() and "without an embedding" not in caplog.text


def test_the_export_refuses_a_model_whose_batch_is_fixed_at_two_and_writes_nothing(tmp_path: Path) -> None:
    # Before: written (the export tried a batch of 2 alone); the server refused it at warm-up with a multi-line
    # TorchScript traceback as its reason, and models.predict ended in a traceback (a new user's trial).
    from models.export.checks import ModelLoadError
    from models.export.write import export_model

    class ExactlyTwo(Means):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x).reshape(2, 4)

    with pytest.raises(ModelLoadError, match=re.escape("the model answers a batch of 2 images but fails on one: its "
                                                       "batch dimension is fixed; export it with a dynamic one")):
        export_model(ExactlyTwo(), out_dir=tmp_path / "out", name="two", version="1", arch="resnet18",
                     labels=["r", "g", "b", "sum"], preset=EvalPreset(resize_size=8, crop_size=8))
    assert not (tmp_path / "out").exists()


def test_the_export_refuses_a_model_ending_in_softmax_and_writes_nothing(tmp_path: Path) -> None:
    from models.export.checks import ModelLoadError
    from models.export.write import export_model

    with pytest.raises(ModelLoadError, match="already probabilities"):
        export_model(Softmaxed(), out_dir=tmp_path / "out", name="soft", version="1", arch="resnet18",
                     labels=["r", "g", "b", "sum"], preset=EvalPreset(resize_size=8, crop_size=8))
    assert not (tmp_path / "out").exists()
