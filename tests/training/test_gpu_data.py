"""The GPU data path on the CPU: the same crops and flips as the CPU path, pixels within a level or two, the same
batches whatever the number of workers, every format (JPEG, grey, CMYK, EXIF-rotated, PNG) through it."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from models.data.augment import RandomCropFlip, draw, train_transform
from models.run.distributed import DistEnv
from models.data.folder import EpochSampler, FolderDataset, scan_split
from models.data.gpu import DeviceAugment, DevicePrefetcher, EncodedFolder, ToDevice, collate
from models.data.loaders import load_data
from demo_data.photos import write_photos
from models.presets import EvalPreset
from models.architectures import ARCHS
from models.run.args import get_args_parser

CPU = torch.device("cpu")
PRESET = EvalPreset(resize_size=72, crop_size=64, interpolation="bilinear")


def _odd_files(folder: Path) -> None:
    """One of each kind the fast path does not take as it comes, in the first class of ``folder/train``."""
    first = sorted((folder / "train").iterdir())[0]
    photo = Image.open(sorted(first.glob("*.jpg"))[0]).convert("RGB").resize((120, 90))  # landscape
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees: the upright image is portrait
    photo.save(first / "rotated.jpg", quality=95, exif=exif)
    photo.convert("L").save(first / "grey.jpg", quality=95)
    photo.convert("CMYK").save(first / "cmyk.jpg", quality=95)
    photo.save(first / "lossless.png")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("photos")
    write_photos(out, classes=4, train_per_class=6, val_per_class=2, long_side=120, workers=1)
    _odd_files(out)
    return out


def test_the_draw_is_torchvisions_random_resized_crop_and_flip() -> None:
    from torchvision.transforms import v2 as T

    reference = T.Compose([T.RandomResizedCrop(48, scale=(0.08, 1.0), antialias=True), T.RandomHorizontalFlip(0.5)])
    # A wide, a tall and a square image: the tall and wide ones also reach the centred fallback.
    for size in ((300, 40), (40, 300), (120, 120)):
        image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (*size[::-1], 3), dtype=np.uint8))
        mine = RandomCropFlip(EvalPreset(resize_size=56, crop_size=48), 0.5, 0.08)
        for seed in range(40):
            torch.manual_seed(seed)
            expected = np.asarray(reference(image))
            torch.manual_seed(seed)
            assert np.array_equal(np.asarray(mine(image)), expected), (size, seed)


def test_a_sample_gets_the_same_crop_on_both_paths_and_nearly_the_same_pixels(folder: Path) -> None:
    split = scan_split(folder / "train")
    cpu_set = FolderDataset(split.samples, train_transform(PRESET), seed=7)
    gpu_set = EncodedFolder(split.samples, min_crop_scale=0.08, hflip_prob=0.5, seed=7)
    augment = DeviceAugment(PRESET, CPU, torch.contiguous_format)
    names = [path.name for path, _ in split.samples]
    assert {"rotated.jpg", "grey.jpg", "cmyk.jpg", "lossless.png"} <= set(names)
    for epoch in (0, 3):
        keys = [(epoch, index) for index in range(len(split.samples))]
        images, targets = augment(collate([gpu_set[key] for key in keys]))
        expected = torch.stack([cpu_set[key][0] for key in keys])
        assert targets.tolist() == [target for _, target in split.samples]
        assert images.shape == expected.shape == (len(keys), 3, 64, 64)
        # In 0..255 levels: the same box and flip, resized by PIL or by torchvision's uint8 kernel.
        levels = ((images - expected) * torch.tensor(PRESET.std).view(1, 3, 1, 1) * 255).abs()
        per_image_mean = levels.flatten(1).mean(1)
        assert per_image_mean.max() < 1.0, dict(zip(names, per_image_mean.tolist()))
        assert levels.max() <= 6


def test_the_upright_size_comes_from_the_header(folder: Path) -> None:
    split = scan_split(folder / "train")
    index = next(i for i, (path, _) in enumerate(split.samples) if path.name == "rotated.jpg")
    stored = Image.open(split.samples[index][0]).size  # (width, height) as stored: landscape
    dataset = EncodedFolder(split.samples, min_crop_scale=1.0, hflip_prob=0.0, seed=0)
    payload, box, _ = dataset[(0, index)]
    assert payload.ndim == 1  # the worker sent the bytes, not pixels
    # A full-area crop is the whole upright (portrait) image, or its centred 3:4 part.
    assert stored[0] > stored[1] and box[2] > box[3]


def _batches(folder: Path, workers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    split = scan_split(folder / "train")
    dataset = EncodedFolder(split.samples, min_crop_scale=0.08, hflip_prob=0.5, seed=1)
    sampler = EpochSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=1)
    sampler.set_epoch(2)
    loader = DataLoader(dataset, batch_size=5, sampler=sampler, num_workers=workers, collate_fn=collate)
    return list(DevicePrefetcher(loader, DeviceAugment(PRESET, CPU, torch.channels_last), CPU))


def test_batches_do_not_depend_on_the_number_of_workers(folder: Path) -> None:
    alone, shared = _batches(folder, 0), _batches(folder, 2)
    assert len(alone) == len(shared) == 6  # 28 samples in batches of 5
    for (a, ta), (b, tb) in zip(alone, shared):
        assert torch.equal(a, b) and torch.equal(ta, tb)
        assert a.is_contiguous(memory_format=torch.channels_last)


def test_the_cpu_path_prepares_batches_the_same_way() -> None:
    images, targets = torch.rand(2, 3, 8, 8), torch.tensor([1, 0])
    prefetched = list(DevicePrefetcher([(images, targets)], ToDevice(CPU, torch.channels_last), CPU))  # type: ignore[arg-type]
    assert len(prefetched) == 1 and torch.equal(prefetched[0][0], images)
    assert prefetched[0][0].is_contiguous(memory_format=torch.channels_last)


def test_load_data_builds_the_chosen_path(folder: Path) -> None:
    env = DistEnv(rank=0, world_size=1, local_rank=0)
    for backend, kind in (("cpu", FolderDataset), ("gpu", EncodedFolder)):
        args = get_args_parser(ARCHS).parse_args(["--data", str(folder), "--data-backend", backend,
                                                  "--workers", "0", "--crop-size", "64", "--resize-size", "72"])
        data = load_data(args, PRESET, env, CPU)
        assert isinstance(data.train.dataset, kind)
        images, targets = next(iter(DevicePrefetcher(data.train, data.prepare, CPU)))
        assert images.shape == (28, 3, 64, 64) and targets.shape == (28,)  # one batch of 32 holds all 28


def test_a_seed_writes_the_same_photos(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    counts = write_photos(a, classes=3, train_per_class=2, val_per_class=1, long_side=64, workers=1)
    write_photos(b, classes=3, train_per_class=2, val_per_class=1, long_side=64, workers=1)
    files = sorted(p.relative_to(a) for p in a.rglob("*.jpg"))
    assert counts["train"] == 6 and counts["val"] == 3 and len(files) == 9
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    assert len({f.parts[1] for f in files}) == 3  # three classes, from three different photos
    with pytest.raises(ValueError):
        write_photos(tmp_path / "c", classes=1000)


def test_draw_is_seeded_by_the_global_generator_only() -> None:
    torch.manual_seed(3)
    first = draw(375, 500, 0.08, 0.5)
    torch.manual_seed(3)
    assert draw(375, 500, 0.08, 0.5) == first


@pytest.mark.slow  # loads the packaged ImageNet weights; about 30 s on 2 cores
def test_a_fine_tune_learns_the_same_on_both_paths(tmp_path: Path) -> None:
    from models import train
    from models.run.report import read_metrics

    data = tmp_path / "photos"
    write_photos(data, classes=5, train_per_class=24, val_per_class=8, long_side=160)
    results = {}
    for backend in ("cpu", "gpu"):
        run = tmp_path / backend
        assert train.main(["--data", str(data), "--arch", "efficientnet_lite0", "--pretrained", "--freeze-backbone",
                           "--epochs", "2", "--batch-size", "20", "--crop-size", "128", "--resize-size", "146",
                           "--workers", "1", "--device", "cpu", "--lr", "0.05",
                           "--data-backend", backend, "--output-dir", str(run)]) == 0
        results[backend] = read_metrics(run)[-1]
    cpu, gpu = results["cpu"], results["gpu"]
    assert cpu["val_acc1"] > 0.8  # it learned (5 classes: chance is 0.2)
    assert abs(cpu["val_acc1"] - gpu["val_acc1"]) <= 1 / 40 + 1e-9  # at most one of the 40 val images apart
    assert gpu["train_loss"] == pytest.approx(cpu["train_loss"], rel=0.02)


@pytest.mark.gpu
def test_on_cuda_the_gpu_path_gives_the_cpu_decoders_batches(folder: Path) -> None:
    """nvJPEG and the CUDA resize against libjpeg-turbo and the CPU resize, through the side-stream prefetcher."""
    cuda = torch.device("cuda")
    split = scan_split(folder / "train")
    dataset = EncodedFolder(split.samples, min_crop_scale=0.08, hflip_prob=0.5, seed=5)
    loader = DataLoader(dataset, batch_size=7, collate_fn=collate, pin_memory=True)
    on_cpu = list(DevicePrefetcher(loader, DeviceAugment(PRESET, CPU, torch.contiguous_format), CPU))
    on_gpu = list(DevicePrefetcher(loader, DeviceAugment(PRESET, cuda, torch.channels_last), cuda))
    assert len(on_cpu) == len(on_gpu) == 4
    for (a, ta), (b, tb) in zip(on_cpu, on_gpu):
        assert b.device.type == "cuda" and b.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(ta, tb.cpu())
        levels = ((b.cpu() - a) * torch.tensor(PRESET.std).view(1, 3, 1, 1) * 255).abs()
        # Decoders and resize kernels differ by a level or two: on an H100 (2026-11-27) a mean of 0.16 to 2.18
        # levels per sample, the most on a small crop enlarged, which magnifies nvJPEG's and libjpeg-turbo's
        # different chroma upsampling. A wrong channel order or normalisation is tens of levels.
        assert levels.flatten(1).mean(1).max() < 3.0


def test_the_prefetcher_prepares_on_one_stream_a_device_drawn_once_from_a_pool_decoding_does_not_use(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # PyTorch hands a pool's 32 streams out in turn: a stream drawn every epoch from the default pool would in time
    # be the JPEG decoding's own, which then no longer orders nvJPEG's output against its caller
    import models.data.gpu as gpu
    import models.data.jpeg as jpeg
    from tests.support.fakes import PooledStreams

    streams = PooledStreams(highest=-3)
    monkeypatch.setattr(torch.cuda, "Stream", streams.Stream)
    monkeypatch.setattr(gpu, "_prefetch_streams", {})
    monkeypatch.setattr(jpeg, "_DECODE_STREAMS", {})
    device = torch.device("cuda", 0)
    prefetch = gpu.prefetch_stream(device)
    assert [gpu.prefetch_stream(device) for _ in range(40)] == [prefetch] * 40  # an epoch's iteration each
    jpeg.decode_stream(device)
    assert streams.made == [(device, gpu.PREFETCH_PRIORITY), (device, 0)] and gpu.PREFETCH_PRIORITY != 0
