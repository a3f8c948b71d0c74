"""``python -m models.train --weights FILE``: a run started from weights trained elsewhere (a state dict of any timm
or torchvision model, or another run's checkpoint), every layer but the head, which is new for the data's classes,
with the normalisation they were trained with; and every file that is not such weights refused in one line before
the data is scanned (before: --arch took four names, and only the packaged EfficientNet-Lite0 could be fine-tuned)."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from app.engine.loaded.predictor import Predictor
from models import train
from models.architectures import ARCHS, LIBRARIES, build_model, class_sized, head_name
from models.export.manifest import read_manifest
from models.run import args as run_args
from models.run.args import get_args_parser
from models.run.checkpoint import BEST_NAME, CHECKPOINT_NAME
from models.run.optim import make_optimizer
from models.run.start_weights import read_start_weights, with_body
from tests.support.imaging import write_image_folder
from tests.training.test_training_checks import _main_error

ARCH = "timm:mobilenetv3_small_050"  # 1.6 M parameters: a second's epoch on the tiny folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_image_folder(tmp_path_factory.mktemp("folder"))


@pytest.fixture(scope="module")
def imagenet_like(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """Weights of ARCH with a 1000-class head, saved as a DDP run saves them (``module.`` before every name)."""
    import timm

    torch.manual_seed(1)
    weights = timm.create_model(ARCH.removeprefix("timm:"), num_classes=1000).state_dict()
    path = tmp_path_factory.mktemp("weights") / "imagenet_like.pt"
    torch.save({f"module.{key}": value for key, value in weights.items()}, path)
    return path, weights


def _args(data: Path, out: Path, *extra: str) -> list[str]:
    return ["--data", str(data), "--epochs", "1", "--batch-size", "6", "--workers", "0", "--crop-size", "32",
            "--device", "cpu", "--lr", "0.01", "--output-dir", str(out), *extra]


@pytest.mark.slow  # runs of the CLI: seconds each
def test_a_run_starts_from_the_weights_body_with_a_new_head_and_its_normalisation_is_served(
        folder: Path, imagenet_like: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    path, weights = imagenet_like
    out = tmp_path / "run"
    assert train.main(_args(folder, out, "--arch", ARCH, "--weights", str(path), "--freeze-backbone", "--mean",
                            "0.5", "0.5", "0.5", "--std", "0.5", "0.5", "0.5", "--export", str(out / "export"))) == 0
    best = torch.load(out / BEST_NAME, weights_only=True)
    head = f"{head_name(build_model(ARCH, 3))}."
    trained = best["model"]
    frozen = [key for key in weights if not key.startswith(head) and "running_" not in key
              and "num_batches" not in key]
    assert frozen and all(torch.equal(trained[key], weights[key]) for key in frozen)  # the file's, not random
    assert trained[f"{head}weight"].shape[0] == 3 and best["classes"] == ["blue", "green", "red"]
    assert best["args"]["weights"] == str(path) and best["args"]["mean"] == [0.5, 0.5, 0.5]

    manifest = read_manifest(out / "export")
    assert manifest.arch == ARCH and manifest.preprocess.mean == (0.5, 0.5, 0.5)
    assert manifest.preprocess.std == (0.5, 0.5, 0.5)
    served = Predictor.load(out / "export", device="cpu")  # the server builds the library's model by its name
    assert served.manifest.labels == ["blue", "green", "red"]

    # the export (its folder) starts the next run, normalised as it was unless told otherwise
    again = tmp_path / "again"
    assert train.main(_args(folder, again, "--arch", ARCH, "--weights", str(out / "export"), "--std", "0.25",
                            "0.25", "0.25")) == 0
    preset = torch.load(again / BEST_NAME, weights_only=True)["preset"]
    assert (preset["mean"], preset["std"]) == ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))


@pytest.mark.slow  # runs of the CLI: seconds each
def test_a_resumed_run_keeps_its_normalisation_and_needs_its_weights_file_no_more(
        folder: Path, imagenet_like: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    copy = tmp_path / "weights.pt"
    shutil.copy(imagenet_like[0], copy)
    out = tmp_path / "run"
    assert train.main(_args(folder, out, "--arch", ARCH, "--weights", str(copy), "--mean", "0.4", "0.4", "0.4")) == 0
    copy.unlink()
    checkpoint = str(out / CHECKPOINT_NAME)
    assert "--resume goes on from its checkpoint's weights" in _main_error(
        ["--resume", checkpoint, "--weights", str(imagenet_like[0])], caplog)
    assert f"started from --weights {copy}, not the packaged weights: leave --pretrained out" in _main_error(
        ["--resume", checkpoint, "--pretrained"], caplog)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="models.train"):
        assert train.main(["--resume", checkpoint, "--epochs", "2", "--workers", "0", "--device", "cpu"]) == 0
    assert any("--mean 0.4 0.4 0.4" in r.getMessage() for r in caplog.records)
    assert torch.load(out / CHECKPOINT_NAME, weights_only=True)["preset"]["mean"] == (0.4, 0.4, 0.4)


@pytest.mark.slow  # runs of the CLI: seconds each
def test_another_run_s_checkpoint_seeds_a_run_on_other_classes(folder: Path, tmp_path: Path) -> None:
    first = tmp_path / "first"
    assert train.main(_args(folder, first, "--arch", ARCH, "--mean", "0.3", "0.3", "0.3")) == 0
    two_classes = tmp_path / "two"
    for split in ("train", "val"):
        for name in ("red", "blue"):
            shutil.copytree(folder / split / name, two_classes / split / name)
    second = tmp_path / "second"
    assert train.main(_args(two_classes, second, "--arch", ARCH, "--weights", str(first / BEST_NAME),
                            "--freeze-backbone")) == 0
    earlier, now = (torch.load(run / BEST_NAME, weights_only=True)["model"] for run in (first, second))
    head = f"{head_name(build_model(ARCH, 2))}."
    assert now[f"{head}weight"].shape[0] == 2
    assert all(torch.equal(now[key], earlier[key]) for key in earlier
               if not key.startswith(head) and "running_" not in key and "num_batches" not in key)
    assert torch.load(second / BEST_NAME, weights_only=True)["preset"]["mean"] == (0.3, 0.3, 0.3)  # the run's


@pytest.mark.parametrize(("extra", "says"), [
    (["--arch", "resnet18"], "holds no weights of resnet18"),  # another network's weights
    (["--arch", "timm:no_such_model"], "timm has no model 'no_such_model'"),
    (["--arch", ARCH, "--pretrained"], "--pretrained starts from the packaged ImageNet weights"),
    (["--pretrained", "--mean", "0.5", "0.5", "0.5"], "--pretrained's weights were trained with their own"),
])
def test_weights_of_another_network_are_refused_in_one_line_before_the_data_is_scanned(
        extra: list[str], says: str, imagenet_like: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    missing_data = tmp_path / "no-data-here"  # the weights are judged first: no word of the data
    weights = [] if "--pretrained" in extra and "--mean" in extra else ["--weights", str(imagenet_like[0])]
    error = _main_error(_args(missing_data, tmp_path / "run", *weights, *extra), caplog)
    assert says in error and "no-data-here" not in error


def test_weights_saved_otherwise_than_torch_save_of_the_model_s_own_are_read(
        imagenet_like: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    _, weights = imagenet_like
    sized = class_sized(ARCH)
    forms = {"lightning.ckpt": {"state_dict": {f"model.{key}": value for key, value in weights.items()}},
             "no_step_counts.pt": {key: value for key, value in weights.items()  # (older torchvision files)
                                   if not key.endswith("num_batches_tracked")}}
    for name, saved in forms.items():
        torch.save(saved, tmp_path / name)
        body = read_start_weights(tmp_path / name, ARCH).body
        model = with_body(build_model(ARCH, 3), body)
        assert all(torch.equal(model.state_dict()[key], weights[key]) for key in body), name
        assert not sized & body.keys() and sized, name


def test_the_parser_names_the_libraries_the_models_are_built_from() -> None:
    # models/run/args.py names them itself (it imports no torch: models.neighbours' command runs without it)
    assert run_args.LIBRARIES == tuple(LIBRARIES)


def test_layers_the_class_count_sizes_are_the_head_and_train_at_its_rate() -> None:
    assert class_sized("resnet18") == {"fc.weight", "fc.bias"}  # as the last Linear layer was
    assert class_sized("torchvision:squeezenet1_0") == {"classifier.1.weight", "classifier.1.bias"}  # a conv
    assert {"head.weight", "head_dist.weight"} <= class_sized("timm:deit_tiny_distilled_patch16_224")
    args = get_args_parser(ARCHS).parse_args(["--data", "x", "--arch", "torchvision:squeezenet1_0",
                                              "--backbone-lr-scale", "0.1", "--lr", "0.01"])
    model = build_model(args.arch, 3)
    head, backbone = make_optimizer(model, args).param_groups
    assert [p.shape for p in head["params"]] == [(3, 512, 1, 1), (3,)] and head["lr"] == 0.01
    assert len(backbone["params"]) == len(list(model.parameters())) - 2 and backbone["lr"] == pytest.approx(0.001)


@pytest.mark.slow  # runs of the CLI: seconds each
def test_what_is_no_state_dict_is_refused_saying_what_to_give(folder: Path, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture,
                                                               recwarn: pytest.WarningsRecorder) -> None:
    model = build_model(ARCH, 3).eval()
    scripted = tmp_path / "model.torchscript.pt"
    torch.jit.save(torch.jit.trace(model, torch.rand(1, 3, 32, 32)), scripted)
    recwarn.clear()
    assert "give its state dict" in _main_error(_args(folder, tmp_path / "a", "--arch", ARCH, "--weights",
                                                      str(scripted)), caplog)
    assert not [w for w in recwarn if "TorchScript" in str(w.message)]  # said once, in its line: no torch warning
    pickled = tmp_path / "pickled.pt"
    torch.save(model, pickled)
    assert "save the weights alone" in _main_error(_args(folder, tmp_path / "b", "--arch", ARCH, "--weights",
                                                         str(pickled)), caplog)
    assert "--weights" in _main_error(_args(folder, tmp_path / "c", "--arch", ARCH, "--weights",
                                            str(tmp_path / "absent.pt")), caplog)
    for name, content, says in (("empty.pt", b"", "an empty file"), ("model.onnx", b"\x08\x07", "an ONNX file"),
                                ("notes.pt", b"hello", "no file torch.save wrote")):
        (tmp_path / name).write_bytes(content)
        assert says in _main_error(_args(folder, tmp_path / "e", "--arch", ARCH, "--weights", str(tmp_path / name)),
                                   caplog)
    assert "is a folder: give a weights file" in _main_error(_args(folder, tmp_path / "f", "--arch", ARCH,
                                                                   "--weights", str(folder)), caplog)
    assert "answers GoogLeNetOutputs while it trains" in _main_error(_args(folder, tmp_path / "g", "--arch",
                                                                           "torchvision:googlenet"), caplog)
    first = tmp_path / "first"
    assert train.main(_args(folder, first, "--arch", "mobilenet_v3_small", "--export", str(first / "export"))) == 0
    assert "an export of mobilenet_v3_small: give --arch mobilenet_v3_small" in _main_error(
        _args(folder, tmp_path / "h", "--arch", ARCH, "--weights", str(first / "export")), caplog)
    assert "give --arch mobilenet_v3_small" in _main_error(_args(folder, tmp_path / "d", "--arch", ARCH,
                                                                 "--weights", str(first / BEST_NAME)), caplog)


def test_a_normalisation_off_the_0_to_1_scale_is_refused_by_the_parser(folder: Path, tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    for option, values in (("--mean", ["124", "116", "104"]), ("--std", ["0", "0.2", "0.2"])):
        with pytest.raises(SystemExit) as exited:
            train.main(_args(folder, tmp_path / "run", option, *values))
        assert exited.value.code == 2 and f"argument {option}: must be in" in capsys.readouterr().err


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_an_export_s_weights_are_taken_under_either_name_of_their_architecture(tmp_path: Path) -> None:
    # Before: an export written as torchvision:mobilenet_v3_small was refused for --arch mobilenet_v3_small ("give
    # --arch torchvision:mobilenet_v3_small"), the same model under its short name (a new user's trial).
    from models.architectures import same_arch
    from models.export.write import export_model
    from models.export.manifest import EvalPreset

    assert same_arch("mobilenet_v3_small", "torchvision:mobilenet_v3_small")
    assert same_arch("timm:tf_efficientnet_lite0", "efficientnet_lite0") and same_arch("timm:x", "timm:x")
    assert not same_arch("resnet18", "timm:resnet18") and not same_arch("resnet18", "resnet50")
    model = build_model("torchvision:resnet18", 3)
    export_model(model, out_dir=tmp_path / "export", name="m", version="1", arch="torchvision:resnet18",
                 labels=["a", "b", "c"], preset=EvalPreset(resize_size=40, crop_size=32), packages=())
    started = read_start_weights(tmp_path / "export", "resnet18")
    assert set(started.body) and started.preset is not None and started.preset.crop_size == 32
    with pytest.raises(ValueError, match="give --arch torchvision:resnet18"):
        read_start_weights(tmp_path / "export", "resnet50")
