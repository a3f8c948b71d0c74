"""The training script's checks and what a run does with what it is given: options refused before the data scan,
folders and checkpoints that do not fit, resuming elsewhere or with new rates, the eval preset, the export asked
for, images that go bad mid-run, and the figures it writes."""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from models import train
from tests.training.test_training import _stopped_in_its_second_epoch
from models.architectures import ARCHS
from models.data.folder import DataError, scan_split, servable_only, split_holdout, without_trained
from models.data.loaders import load_data
from models.export.__main__ import main as export_main
from models.export.manifest import read_manifest
from models.image_decode import DecodeLimits, decode_image
from models.presets import ServedEvalTransform, eval_transform
from models.run.args import get_args_parser
from models.run.checkpoint import BEST_NAME, CHECKPOINT_NAME, Best, better, load_checkpoint
from models.run.distributed import DistEnv
from models.run.report import METRICS_NAME, read_metrics
from tests.support.imaging import write_image_folder

NO_PACKAGES = ["--packages", "none"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_image_folder(tmp_path_factory.mktemp("folder"))


def small_args(data: Path, out: Path, *extra: str, sizes: tuple[str, ...] = ("--resize-size", "36",
                                                                              "--crop-size", "32")) -> list[str]:
    """Options for a seconds-long CPU run on the tiny folder."""
    return ["--data", str(data), "--arch", "mobilenet_v3_small", "--epochs", "1", "--batch-size", "6",
            "--workers", "0", *sizes, "--device", "cpu", "--lr", "0.01", "--output-dir", str(out), *extra]


def _main_error(argv: list[str], caplog: pytest.LogCaptureFixture) -> str:
    """The one error line ``models.train`` exits 2 with."""
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="models.train"):
        assert train.main(argv) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "\n" not in errors[0], errors
    return errors[0]


def _refused_option(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """argparse's refusal (exit 2) of an option, before anything is read."""
    with pytest.raises(SystemExit) as exited:
        train.main(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_val_split_on_a_train_and_val_folder_is_refused(folder: Path, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    # Before: "train" and "val" became the two classes of the model.
    error = _main_error(small_args(folder, tmp_path / "run", "--val-split", "0.25"), caplog)
    assert f"{folder} has train/ and val/: leave --val-split out" in error
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("splits", [("Train", "Val"), ("training", "validation"), ("Train", "Test", "Valid"),
                                    ("Train", "val")])
def test_a_folder_whose_class_folders_are_named_as_splits_is_refused(splits: tuple[str, ...], folder: Path,
                                                                     tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    # Before: data/{Train,Val}/<class>/ trained a two-class model telling Train from Val, said nowhere (its class
    # folders pooled), a new user's trial; lower-case train/ and val/ are the split layout.
    data = tmp_path / "data"
    for name, split in zip(splits, ("train", "val", "val")):
        shutil.copytree(folder / split, data / name)
    error = _main_error(small_args(data, tmp_path / "run"), caplog)
    assert f"class folders ({', '.join(sorted(splits))}) are named as a dataset's splits" in error
    assert f"give --data {data / splits[0]} to hold out" in error and not (tmp_path / "run").exists()


@pytest.mark.parametrize("option, value, says", [
    ("--min-crop-scale", "0", "must be in (0, 1]"), ("--min-crop-scale", "1.5", "must be in (0, 1]"),
    ("--label-smoothing", "1.5", "must be in [0, 1)"), ("--lr", "-1", "must be above 0"),
    ("--lr", "nan", "must be above 0"), ("--weight-decay", "-1", "must be 0 or more"),
    ("--backbone-lr-scale", "-1", "must be 0 or more"), ("--hflip-prob", "3", "must be in [0, 1]"),
    ("--momentum", "1", "must be in [0, 1)"), ("--val-split", "1", "must be in (0, 1)"),
    ("--clip-grad-norm", "-1", "must be 0 or more"),  # (0: no clipping, to turn a resumed run's off)
])
def test_options_out_of_range_are_refused_before_the_data_is_read(option: str, value: str, says: str,
                                                                  tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # Before: tracebacks deep in torch (--min-crop-scale 0, --label-smoothing 1.5, --lr -1, --weight-decay -1),
    # or a run that trained on them (--backbone-lr-scale -1, --hflip-prob 3). The data folder does not exist: the
    # option is refused first.
    line = _refused_option(["--data", str(tmp_path / "missing"), option, value], capsys)
    assert f"argument {option}: {says}, got {value}" in line


@pytest.fixture(scope="module")
def one_epoch(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of one epoch on the tiny folder (``small_args``), trained once for the tests that resume a copy."""
    run = tmp_path_factory.mktemp("one-epoch") / "run"
    assert train.main(small_args(folder, run, "--epochs", "1")) == 0
    return run


def _resumable(one_epoch: Path, tmp_path: Path) -> tuple[Path, list[str]]:
    """A copy of ``one_epoch`` in ``tmp_path`` (its own to resume), and the options that resume it for a 2nd epoch."""
    run = Path(shutil.copytree(one_epoch, tmp_path / "run"))
    return run, ["--epochs", "2", "--resume", str(run / CHECKPOINT_NAME)]


def test_a_resumed_run_goes_on_in_its_checkpoint_s_folder_unless_told_another() -> None:
    # Before: --resume runs/mine/checkpoint.pt alone branched the run into runs/default (a new user's trial).
    def output_dir(*argv: str) -> Path:
        return get_args_parser(ARCHS).parse_args(["--data", "data/mine", *argv]).output_dir

    assert output_dir("--resume", "runs/mine/checkpoint.pt") == Path("runs/mine")
    assert output_dir() == Path("runs/default")
    assert output_dir("--resume", "runs/mine/checkpoint.pt", "--output-dir", "runs/other") == Path("runs/other")
    assert output_dir("--resume", "runs/mine/best.pt") == Path("runs/default")  # over the run's later epochs: not


@pytest.mark.slow  # a second or more (a run of the CLI, make, or workers sharing a state): the full suite's
def test_resume_of_what_cannot_go_on_is_one_line(folder: Path, one_epoch: Path, tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    run, resume = _resumable(one_epoch, tmp_path)
    # Before: KeyError 'step' at the first AdamW step; a ValueError on the optimiser's parameter groups.
    assert "was trained with --opt sgd, this run with --opt adamw" in _main_error(
        small_args(folder, run, "--opt", "adamw", *resume), caplog)
    assert "was trained without --freeze-backbone, this run with --freeze-backbone" in _main_error(
        small_args(folder, run, "--freeze-backbone", *resume), caplog)
    with caplog.at_level(logging.WARNING, logger="models.train"):  # a random backbone frozen: said
        assert train.main(small_args(folder, run, "--freeze-backbone", *resume)) == 2
    assert ("--freeze-backbone without --pretrained or --weights trains the head alone on a backbone of random "
            "weights") in caplog.text
    # Before: KeyError 'arch' (an export's weights-only state dict), an UnpicklingError (not a torch file).
    weights = tmp_path / "model.state_dict.pt"
    torch.save(load_checkpoint(run / CHECKPOINT_NAME)["model"], weights)
    assert "is no models.train checkpoint" in _main_error(
        small_args(folder, tmp_path / "other", "--resume", str(weights)), caplog)
    garbage = tmp_path / "notes.txt"
    garbage.write_text("not a checkpoint")
    assert "is no checkpoint torch can read" in _main_error(
        small_args(folder, tmp_path / "other", "--resume", str(garbage)), caplog)
    # Before: NotADirectoryError after the data scan.
    assert f"--output-dir {garbage / 'run'} cannot be a folder: {garbage} is a file" in _main_error(
        small_args(folder, garbage / "run"), caplog)


@pytest.mark.slow  # a second or more (a run of the CLI, make, or workers sharing a state): the full suite's
def test_a_resumed_run_makes_its_images_as_its_checkpoint_trained_on(folder: Path, one_epoch: Path, tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    # Before: a run at --crop-size 32 resumed without its sizes trained its next epochs at 224 (the default), and
    # its export was served at 224, unsaid; a --resume naming no file was told its --output-dir held another run.
    run, resume = _resumable(one_epoch, tmp_path)
    assert train.main(small_args(folder, run, *resume, sizes=())) == 0  # its sizes taken from the checkpoint
    resumed = load_checkpoint(run / CHECKPOINT_NAME)
    assert (resumed["epoch"], resumed["preset"]["resize_size"], resumed["preset"]["crop_size"]) == (1, 36, 32)
    assert "crop_size 32 -> 48" in _main_error(
        small_args(folder, run, "--epochs", "3", "--resume", str(run / CHECKPOINT_NAME), sizes=("--resize-size",
                                                                                                  "56", "--crop-size",
                                                                                                  "48")), caplog)
    assert f"--resume {tmp_path / 'nope.pt'} does not exist" in _main_error(
        small_args(folder, run, "--resume", str(tmp_path / "nope.pt")), caplog)
    assert f"--resume {run} is a folder: give the run's checkpoint (--resume {run / CHECKPOINT_NAME})" in _main_error(
        small_args(folder, run, "--resume", str(run)), caplog)


@pytest.mark.slow  # a second or more (a run of the CLI, make, or workers sharing a state): the full suite's
def test_a_run_resumed_into_another_folder_carries_its_best_and_refuses_a_folder_of_another_run(
        folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    real = train.evaluate
    acc1 = iter([0.9, 0.5, 0.5])  # the first epoch is the best; the resumed one does not beat it

    def scored(*args: object, **kwargs: object) -> train.EvalResult:
        result = real(*args, **kwargs)  # type: ignore[arg-type]
        result.acc1 = next(acc1)
        return result

    monkeypatch.setattr(train, "evaluate", scored)
    first, branch, other = tmp_path / "first", tmp_path / "branch", tmp_path / "other"
    assert train.main(small_args(folder, first)) == 0
    assert train.main(small_args(folder, other)) == 0  # a run of its own
    resume = ["--epochs", "2", "--resume", str(first / CHECKPOINT_NAME)]
    # Before: the other run's best.pt stayed, and --export exported it as this run's.
    assert f"{other} holds another run" in _main_error(small_args(folder, other, *resume), caplog)
    # Before: no best.pt in the new folder: "best.pt does not exist", exit 2 after training.
    assert train.main(small_args(folder, branch, *resume)) == 0
    best = load_checkpoint(branch / BEST_NAME)
    assert best["epoch"] == 0 and best["classes"] == ["blue", "green", "red"]
    assert [row["epoch"] for row in read_metrics(branch)] == [0, 1]
    assert load_checkpoint(branch / CHECKPOINT_NAME)["epoch"] == 1
    assert read_metrics(first)[-1]["epoch"] == 0  # the resumed run's folder is left as it was


def _nan_in_second_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    real_epoch, real_step, epochs = train.train_one_epoch, train.train_step, []

    def epoch(*args: object, **kwargs: object) -> dict[str, float]:
        epochs.append(1)
        return real_epoch(*args, **kwargs)  # type: ignore[arg-type]

    def step(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        loss, logits = real_step(*args, **kwargs)  # type: ignore[arg-type]
        return (loss * math.nan if len(epochs) == 2 else loss), logits

    monkeypatch.setattr(train, "train_one_epoch", epoch)
    monkeypatch.setattr(train, "train_step", step)


@pytest.mark.slow  # a second or more (a run of the CLI, make, or workers sharing a state): the full suite's
def test_a_nan_names_its_epoch_from_1_and_a_resume_with_a_lower_lr_takes_it(
        folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    with monkeypatch.context() as patched:
        _nan_in_second_epoch(patched)
        error = _main_error(small_args(folder, run, "--epochs", "3", "--lr-warmup-epochs", "0"), caplog)
    # Before: "in epoch 1" (counted from 0) for the second epoch.
    assert f"became nan in epoch 2; lower --lr or use --clip-grad-norm, then resume from epoch 1's checkpoint with " \
           f"the new value: --resume {run / CHECKPOINT_NAME}" in error
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="models.train"):
        assert train.main(small_args(folder, run, "--epochs", "3", "--lr-warmup-epochs", "0", "--lr", "0.002",
                                     "--backbone-lr-scale", "0.5", "--weight-decay", "0.001",
                                     "--resume", str(run / CHECKPOINT_NAME))) == 0
    assert "resumed with --lr 0.01 -> 0.002, --backbone-lr-scale 1 -> 0.5, --weight-decay 0.0001 -> 0.001" \
           in caplog.text
    # Before: the checkpoint's rates went on (the second epoch at 0.01 x cos(pi / 3) = 0.0075): the advice failed.
    lrs = [row["lr"] for row in read_metrics(run)]
    assert lrs == pytest.approx([0.01, 0.002 * 0.75, 0.002 * 0.25])
    head, backbone = load_checkpoint(run / CHECKPOINT_NAME)["optimizer"]["param_groups"]
    assert backbone["lr"] == pytest.approx(head["lr"] * 0.5) and head["lr"] == pytest.approx(0.0)
    assert head["initial_lr"] == 0.002 and backbone["initial_lr"] == 0.001
    assert head["weight_decay"] == backbone["weight_decay"] == 0.001


def test_resuming_a_stopped_run_with_fewer_epochs_names_its_planned_epochs(
        folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    assert _stopped_in_its_second_epoch(monkeypatch, small_args(folder, run, "--epochs", "3")) == 130
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="models.train"):
        assert train.main(small_args(folder, run, "--epochs", "1", "--resume", str(run / CHECKPOINT_NAME))) == 0
    # Before: "a finished run of 1 epochs ... --epochs 6" of a run planned for 3.
    assert "stopped after 1 of its 3 planned epochs" in caplog.text
    assert f"To go on: --resume {run / CHECKPOINT_NAME} --epochs 3" in caplog.text
    assert "finished run" not in caplog.text


def test_a_crop_size_alone_resizes_in_proportion_and_a_crop_over_the_resize_is_refused(
        folder: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    parse = get_args_parser(ARCHS).parse_args
    # Before: the resize stayed at 256 (--crop-size 32: the centre 1/8 evaluated; 300: 15% black padding).
    assert (train.make_preset(parse(["--data", "x", "--crop-size", "32"])).resize_size,
            train.make_preset(parse(["--data", "x", "--crop-size", "300"])).resize_size,
            train.make_preset(parse(["--data", "x", "--pretrained", "--crop-size", "300"])).resize_size,
            train.make_preset(parse(["--data", "x"])).resize_size) == (37, 343, 343, 256)
    assert "--crop-size 40 is larger than --resize-size 36" in _main_error(
        small_args(folder, tmp_path / "run", sizes=("--resize-size", "36", "--crop-size", "40")), caplog)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # a second or more (a run of the CLI, make, or workers sharing a state): the full suite's
def test_a_run_records_the_proportional_resize_and_no_top5_below_6_classes_and_its_export_follows(
        folder: Path, tmp_path: Path) -> None:
    run, weights = tmp_path / "run", tmp_path / "weights"
    assert train.main(small_args(folder, run, sizes=("--crop-size", "32"))) == 0
    state = load_checkpoint(run / BEST_NAME)
    assert (state["preset"]["resize_size"], state["preset"]["crop_size"]) == (37, 32)
    # Before: val_acc5 1.0 for 3 classes, where top-5 holds every class.
    assert state["metrics"]["val_acc5"] is None
    assert json.loads((run / METRICS_NAME).read_text().splitlines()[0])["val_acc5"] is None
    assert export_main(["--checkpoint", str(run / BEST_NAME), "--out", str(weights), *NO_PACKAGES]) == 0
    manifest = read_manifest(weights)  # what the server reads
    assert (manifest.preprocess.resize_size, manifest.preprocess.crop_size) == (37, 32)
    assert "val_acc1" in manifest.metrics and "val_acc5" not in manifest.metrics
    # An older checkpoint's 1.0 for 3 classes is left out too.
    state["metrics"]["val_acc5"] = 1.0
    torch.save(state, tmp_path / "older.pt")
    assert export_main(["--checkpoint", str(tmp_path / "older.pt"), "--out", str(tmp_path / "older"),
                        *NO_PACKAGES]) == 0
    assert "val_acc5" not in read_manifest(tmp_path / "older").metrics


def test_an_export_that_cannot_be_written_is_refused_before_the_first_epoch_and_a_failed_one_exits_2(
        folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    # Before: --export was dropped silently.
    assert "--export and --export-repository both given" in _main_error(
        small_args(folder, run, "--export", str(tmp_path / "e"), "--export-repository", str(tmp_path / "r")), caplog)
    afile = tmp_path / "afile"
    afile.write_text("x")
    # Before: trained every epoch, then "not exported", exit 0.
    assert f"{afile} cannot be a folder to export into" in _main_error(
        small_args(folder, run, "--export", str(afile)), caplog)
    held = tmp_path / "held"
    held.mkdir()
    (held / "manifest.json").write_text("{}")
    assert f"--export {held} already holds an unreadable model" in _main_error(
        small_args(folder, run, "--export", str(held)), caplog)
    assert not run.exists()  # no epoch ran

    import models.export.write as write

    def refused(*args: object, **kwargs: object) -> object:
        raise ValueError("the export refused it")

    monkeypatch.setattr(write, "export_checkpoint", refused)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="models.train"):
        assert train.main(small_args(folder, run, "--export", str(tmp_path / "weights"))) == 2
    assert "not exported: the export refused it" in caplog.text and "export: " in caplog.text


def test_an_image_that_goes_bad_mid_run_stops_it_in_one_line_naming_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import models.data.loaders as loaders

    data = write_image_folder(tmp_path / "data", train_per_class=2, val_per_class=1)
    real_scan, broken = loaders.scan_split, []

    def scan_then_truncate(root: Path, workers: int = 4) -> object:
        split = real_scan(root, workers)
        if root.name == "train":  # replaced after the check, while the run trains
            path = split.samples[0][0]
            path.write_bytes(path.read_bytes()[:40])
            broken.append(path)
        return split

    monkeypatch.setattr(loaders, "scan_split", scan_then_truncate)
    # Before: a traceback of the DataLoader worker's, naming no file. One worker: the error crosses processes.
    error = _main_error(small_args(data, tmp_path / "run", "--workers", "1", "--batch-size", "2"), caplog)
    assert error.startswith(f"error: {broken[0]} became unreadable after the run checked it")
    assert "then go on with --resume" in error and "Traceback" not in error


def test_files_in_hidden_folders_of_a_class_are_not_trained_on(tmp_path: Path) -> None:
    root = write_image_folder(tmp_path / "data", train_per_class=2, val_per_class=0) / "train"
    thumbs = root / "red" / ".@__thumb"
    thumbs.mkdir()
    (thumbs / "0.png").write_bytes((root / "blue" / "0.png").read_bytes())  # a NAS's thumbnail of another class
    # Before: the thumbnail was a red sample.
    assert all(".@__thumb" not in str(path) for path, _ in scan_split(root).samples)
    assert len(scan_split(root).samples) == 6


def test_an_epoch_of_nan_val_loss_holds_no_tie() -> None:
    assert better(0.5, math.nan, Best())
    # Before: False both ways (NaN compares false): the NaN epoch stayed best against a finite loss.
    assert better(0.5, 0.3, Best(0.5, math.nan))
    assert not better(0.5, math.nan, Best(0.5, 0.3))


def test_an_unreadable_image_is_warned_of_once_by_rank_0(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Before: every rank under torchrun warned of each unreadable image (each scans the folder)
    data = write_image_folder(tmp_path / "data", train_per_class=2, val_per_class=1)
    (data / "train" / "red" / "notes.jpg").write_text("not an image")
    args = get_args_parser(ARCHS).parse_args(["--data", str(data), "--workers", "0", "--crop-size", "32"])
    preset = train.make_preset(args)
    for env, said in ((DistEnv(rank=1, world_size=2), 0), (DistEnv(rank=0, world_size=2), 1)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            load_data(args, preset, env, torch.device("cpu"))
        assert sum("skipping" in r.getMessage() and "notes.jpg" in r.getMessage()
                   for r in caplog.records) == said, env


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_images_the_server_refuses_for_their_size_are_left_out_of_validation_not_training(tmp_path: Path) -> None:
    # Before: a panorama of aspect ratio 33 (the server's 400) and a 42-megapixel PNG (its 413) were validated on:
    # the run's val top-1 counted images models.predict and the server refuse (a new user's trial). Training keeps
    # them (a phone's 48-megapixel photos train as any other).
    data = write_image_folder(tmp_path / "data", train_per_class=2, val_per_class=1)
    Image.new("RGB", (2000, 60), (200, 10, 10)).save(data / "val" / "red" / "panorama.jpg")
    Image.new("RGB", (7000, 6000), (10, 10, 200)).save(data / "val" / "blue" / "huge.png", compress_level=1)
    Image.new("RGB", (7000, 6000), (10, 10, 200)).save(data / "train" / "blue" / "huge.png", compress_level=1)
    train_split, val = scan_split(data / "train"), servable_only(scan_split(data / "val"))
    assert {path.name: reason for path, reason in val.skipped} == {
        "panorama.jpg": "the image is 2000x60; its aspect ratio is over 20: the server refuses it, so validation "
                        "leaves it out",
        "huge.png": "the image is 7000x6000 = 42000000 pixels; the limit is 40000000: the server refuses it, so "
                    "validation leaves it out"}
    assert not any(path.name in ("panorama.jpg", "huge.png") for path, _ in val.samples)
    assert "huge.png" in {path.name for path, _ in train_split.samples} and not train_split.skipped


def test_a_progressive_jpeg_the_server_refuses_for_its_scans_is_left_out_of_validation(tmp_path: Path) -> None:
    # Before: only the size was judged: a JPEG the server refuses for its scans (400) was validated on (a messy-data
    # trial; the server counts the scan markers, a comment's too, as here)
    data = write_image_folder(tmp_path / "data", train_per_class=2, val_per_class=2)
    Image.new("RGB", (64, 64), (200, 10, 10)).save(data / "val" / "red" / "scans.jpg", progressive=True,
                                                   comment=b"\xff\xda" * 70)
    val = servable_only(scan_split(data / "val"))
    assert {path.name: reason for path, reason in val.skipped} == {
        "scans.jpg": "the progressive JPEG has 80 scans; the limit is 64 (each decodes the whole image again; "
                     "encoders write about 10): the server refuses it, so validation leaves it out"}
    # a class left with no image the server takes is refused, as one with no readable image is (before: trained
    # on, with a class of support 0 in its validation)
    for path in (data / "val" / "blue").iterdir():
        path.unlink()
    Image.new("RGB", (2000, 60), (10, 10, 200)).save(data / "val" / "blue" / "panorama.jpg")
    with pytest.raises(DataError, match=r"with no image the server takes .*: blue$"):
        servable_only(scan_split(data / "val"))


def test_a_link_whose_target_is_gone_is_skipped_saying_so(tmp_path: Path) -> None:
    # Before: left out unsaid and uncounted, where models.predict said "cannot read the file" (a messy-data trial)
    data = write_image_folder(tmp_path / "data", train_per_class=2, val_per_class=1)
    (data / "train" / "red" / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    (data / "train" / "red" / "loop").symlink_to(data / "train" / "red")  # a link to a folder: not followed
    reasons = dict(scan_split(data / "train").skipped)
    assert list(reasons) == [data / "train" / "red" / "gone.jpg"]
    assert reasons[data / "train" / "red" / "gone.jpg"].startswith("FileNotFoundError: ")


def test_a_file_under_two_names_is_read_once_and_never_on_both_sides(tmp_path: Path) -> None:
    # Before: a link and its target were two images: split by their names, one could be held out while the other
    # trained (a messy-data trial: held_out.txt listed a link to a trained file), a val/ link into train/ was
    # validated on, and a link into another class trained the file under two labels
    data = write_image_folder(tmp_path / "data", train_per_class=4, val_per_class=2)
    red = sorted((data / "train" / "red").iterdir())
    (data / "train" / "red" / "zz-again.png").symlink_to(red[0])
    (data / "train" / "blue" / "zz-red.png").symlink_to(red[1])
    (data / "val" / "red" / "zz-trained.png").symlink_to(red[2])
    train_split = scan_split(data / "train")
    assert dict(train_split.skipped) == {
        data / "train" / "blue" / "zz-red.png": f"the same file as {red[1]} (a link): read once, under that name",
        data / "train" / "red" / "zz-again.png": f"the same file as {red[0]} (a link): read once, under that name"}
    val = without_trained(scan_split(data / "val"), train_split)
    assert dict(val.skipped) == {data / "val" / "red" / "zz-trained.png": (
        f"the same file as {red[2]} (a link): training reads it, so validation leaves it out")}
    held, trained = split_holdout(scan_split(data / "train"), 0.5, seed=0)  # one folder held out in part
    assert not {os.path.realpath(p) for p, _ in held.samples} & {os.path.realpath(p) for p, _ in trained.samples}


def test_training_says_each_class_s_images_and_warns_of_one_far_smaller(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Before: totals only, and only when a file was skipped: a class of 1 image against 32 went unsaid (a messy-data
    # trial)
    data = write_image_folder(tmp_path / "data", train_per_class=10, val_per_class=1)
    for path in sorted((data / "train" / "green").iterdir())[1:]:
        path.unlink()
    args = get_args_parser(ARCHS).parse_args(["--data", str(data), "--workers", "0", "--crop-size", "32"])
    with caplog.at_level(logging.INFO, logger="models.train"):
        load_data(args, train.make_preset(args), DistEnv(), torch.device("cpu"))
    said = [r.getMessage() for r in caplog.records]
    assert "images a class (trained on / validated on), fewest first: green 1/1, blue 10/1, red 10/1" in said
    assert ("class green has 1 training image(s) against 10 for red: a model trained on so few seldom answers it; "
            "add images to it") in said


def test_validation_decodes_a_large_jpeg_as_the_server_does(tmp_path: Path) -> None:
    data = write_image_folder(tmp_path / "data", train_per_class=2, val_per_class=1)
    rng = np.random.default_rng(0)
    big = data / "val" / "red" / "big.jpg"  # both sides over twice JPEG_DRAFT_MIN_SIDE: the server decodes at 1/2
    Image.fromarray(rng.integers(0, 255, (2100, 2100, 3), dtype=np.uint8)).save(big, quality=90)
    args = get_args_parser(ARCHS).parse_args(["--data", str(data), "--workers", "0", "--crop-size", "32"])
    preset = train.make_preset(args)
    loaded = load_data(args, preset, DistEnv(), torch.device("cpu"))
    val = loaded.val.dataset
    index = next(i for i, (path, _) in enumerate(val.samples) if path == big)  # type: ignore[attr-defined]
    served = ServedEvalTransform(preset)(decode_image(big.read_bytes(), DecodeLimits()))
    with Image.open(big) as image:
        image.load()
        full = ServedEvalTransform(preset)(image.convert("RGB"))
    assert not torch.equal(served, full)  # the two decodes differ on this photo
    # Before: the full-size decode, so evaluate() scored other pixels than the server serves.
    assert torch.equal(val[index][0], served)


def test_validation_preprocesses_as_the_cpu_server_does(tmp_path: Path) -> None:
    # Before: PIL's eval transform, a level away from the server's tensor transform at some pixels of an upscaled
    # small image: a new user's unsure digits model reported val top-1 0.6438 where the server answered 0.6575.
    from app.engine.decoding.image import DecodeLimits as ServedLimits
    from app.engine.decoding.tensor import image_to_tensor_path
    from models.presets import TensorEvalTransform

    data = write_image_folder(tmp_path / "data", train_per_class=2, val_per_class=1)
    small = data / "val" / "red" / "small.png"  # a digit-sized image the preset enlarges
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(small)
    args = get_args_parser(ARCHS).parse_args(["--data", str(data), "--workers", "0", "--crop-size", "32"])
    preset = train.make_preset(args)
    val = load_data(args, preset, DistEnv(), torch.device("cpu")).val.dataset
    index = next(i for i, (path, _) in enumerate(val.samples) if path == small)  # type: ignore[attr-defined]
    served = image_to_tensor_path(small.read_bytes(), TensorEvalTransform(preset), ServedLimits())
    with Image.open(small) as image:
        assert not torch.equal(eval_transform(preset)(image.convert("RGB")), served)  # PIL's resize differs here
    assert torch.equal(val[index][0], served)


@pytest.mark.slow  # a second or more (a run of the CLI, make, or workers sharing a state): the full suite's
def test_a_run_resumed_from_its_checkpoint_alone_goes_on_with_its_own_options(
        folder: Path, one_epoch: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Before (a data scientist's trial): --resume asked for --data again, then for every option that shaped the run
    # (--pretrained, --freeze-backbone, --opt: one refusal each), and went on at the default --lr where the run
    # had another one, unsaid. Now what the command line does not give is the run's own.
    run, _ = _resumable(one_epoch, tmp_path)
    with caplog.at_level(logging.INFO, logger="models.train"):
        assert train.main(["--resume", str(run / CHECKPOINT_NAME), "--epochs", "2", "--workers", "0",
                           "--device", "cpu"]) == 0
    first, resumed = load_checkpoint(one_epoch / CHECKPOINT_NAME), load_checkpoint(run / CHECKPOINT_NAME)
    assert resumed["epoch"] == 1 and resumed["args"]["epochs"] == 2  # as given
    for name in ("data", "arch", "batch_size", "lr", "resize_size", "crop_size", "opt", "val_split", "split_seed",
                 "pretrained", "freeze_backbone", "seed"):
        assert resumed["args"][name] == first["args"][name], name
    assert f"resuming {run / CHECKPOINT_NAME} with its run's --data {folder}, --arch mobilenet_v3_small" in caplog.text
    assert "the following arguments are required: --data (or --resume of a run's checkpoint)" in _refused_option(
        ["--epochs", "2"], capsys)


@pytest.mark.slow  # seconds: a training and its resumes (the fast subset stays under a minute)
def test_a_resume_takes_the_run_s_options_not_given_derives_again_what_it_derived_and_turns_off_what_is_said(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # (a review) --amp, --freeze-bn and --clip-grad-norm taken from the run could not be turned off; an --lr the run
    # derived from its batch stayed fixed for another --batch-size; a file that is no checkpoint, with no --data,
    # ended in a traceback; a saved --data that moved was "does not exist" with no word of where it came from
    from models.run.checkpoint import resumed_run

    data = write_image_folder(tmp_path / "data")
    path = tmp_path / "run" / CHECKPOINT_NAME
    path.parent.mkdir()
    run = {"data": str(data), "arch": "mobilenet_v3_small", "amp": True, "amp_dtype": "fp16", "freeze_bn": True,
           "clip_grad_norm": 1.0, "lr": 0.0015625, "lr_from_batch": True, "batch_size": 4, "epochs": 3}
    torch.save({"args": run}, path)

    def resumed(*argv: str) -> object:
        args = get_args_parser(ARCHS).parse_args(["--resume", str(path), *argv])
        resumed_run(args)
        return args

    taken = resumed()
    assert (taken.data, taken.arch, taken.amp, taken.amp_dtype, taken.freeze_bn, taken.clip_grad_norm,
            taken.batch_size, taken.epochs) == (data, "mobilenet_v3_small", True, "fp16", True, 1.0, 4, 3)
    assert taken.lr is None  # derived again, for this run's global batch
    off = resumed("--no-amp", "--no-freeze-bn", "--clip-grad-norm", "0", "--epo", "5", "--batch-size=8")
    assert (off.amp, off.amp_dtype, off.freeze_bn, off.clip_grad_norm, off.epochs, off.batch_size) == (
        False, None, False, 0.0, 5, 8)
    # another network named: said as that, before its other options are judged (a pretrained run resumed with
    # --arch resnet18 said "no packaged ImageNet weights for 'resnet18'": a data scientist's trial)
    with pytest.raises(DataError, match=r"was trained as mobilenet_v3_small, not resnet18: leave --arch out"):
        resumed("--arch", "resnet18")
    assert resumed("--arch", "mobilenet_v3_small").arch == "mobilenet_v3_small"  # its own, given: taken
    torch.save({"args": {**run, "lr_from_batch": False}}, path)
    assert resumed().lr == 0.0015625  # one the run was given stays
    shutil.rmtree(data)  # moved since
    assert f"--data {data} (the run's, from {path}) does not exist" in _main_error(
        ["--resume", str(path), "--device", "cpu"], caplog)
    path.write_text("not a checkpoint")
    assert "is no checkpoint torch can read" in _main_error(["--resume", str(path)], caplog)
