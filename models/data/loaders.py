"""The data of a training run: the train and val splits of the folder, checked, and their sharded loaders."""
from __future__ import annotations

import argparse
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader, Dataset

from models.data.augment import train_transform
from models.data.folder import (
    EpochSampler,
    FolderDataset,
    ShardSampler,
    Split,
    check_same_classes,
    scan_split,
    servable_only,
    split_holdout,
    without_trained,
)
from models.data.gpu import DeviceAugment, EncodedFolder, Prepare, ToDevice, collate
from models.presets import EvalPreset, ServedEvalTransform
from models.run.args import DataError
from models.run.distributed import DistEnv

log = logging.getLogger("models.train")


@dataclass
class Data:
    """The loaders of one run and the class names they index."""

    train: DataLoader
    val: DataLoader
    train_sampler: EpochSampler
    classes: list[str]
    val_files: list[Path]
    prepare: Prepare  # a train batch -> (images, targets) on the device, in the training memory format


DEFAULT_VAL_SPLIT = 0.2  # a DIR/<class>/* folder without --val-split
SPLIT_NAMES = frozenset({"train", "training", "val", "valid", "validation", "test", "testing", "eval"})


def _check_not_splits_as_classes(data: Path) -> None:
    """DataError when every class folder of ``data`` is named as a split, one of them a training split (``Train/``
    and ``Val/``, ``training/`` and ``validation/``): its images would train a model that tells the splits apart
    (their class folders pooled)."""
    names = sorted(p.name for p in data.iterdir() if p.is_dir() and not p.name.startswith("."))
    training = next((name for name in names if name.lower().startswith("train")), None)
    if training is not None and len(names) >= 2 and all(name.lower() in SPLIT_NAMES for name in names):
        raise DataError(f"{data}'s class folders ({', '.join(names)}) are named as a dataset's splits, not as "
                        f"classes: lay it out as {data}/train/<class name>/ and {data}/val/<class name>/ (train and "
                        f"val, lower case), or give --data {data / training} to hold out part of it for validation")


def splits(args: argparse.Namespace) -> tuple[Split, Split]:
    """DIR/train and DIR/val, or with --val-split one DIR/<class> folder split in two."""
    workers = max(4, args.workers)
    laid_out = [name for name in ("train", "val") if (args.data / name).is_dir()]
    if args.val_split is not None and laid_out:  # they would be split as two classes named train and val
        raise DataError(f"--val-split holds out part of a DIR/<class>/* folder, but {args.data} has "
                        f"{' and '.join(f'{name}/' for name in laid_out)}: leave --val-split out to validate on "
                        f"{args.data / 'val'}, or give --data {args.data / 'train'} to split that")
    said = ""
    if args.val_split is None and not (args.data / "train").is_dir() and args.data.is_dir() and any(
            p.is_dir() and p.name not in ("train", "val") for p in args.data.iterdir()):
        args.val_split = DEFAULT_VAL_SPLIT
        said = f"{args.data} has no train/ and val/ folders: "
    if args.val_split is not None:
        _check_not_splits_as_classes(args.data)  # its folders are the classes: not a dataset's splits
        kept = getattr(args, "_resumed_sides", None)  # a resumed run's sides (models/run/checkpoint.py)
        if kept is None and hasattr(args, "_resumed_sides"):  # resumed, from a checkpoint that did not record them
            log.warning("%s does not record which images its run held out (a checkpoint from before they were "
                        "saved): images added or removed since may have moved a trained one into validation",
                        args.resume)
        train_split, val_split = split_holdout(scan_split(args.data, workers=workers), args.val_split,
                                                args.split_seed, kept)
        args._split_sides = (_relative(val_split), _relative(train_split))  # for this run's checkpoints
        held, whole = len(val_split.samples), len(val_split.samples) + len(train_split.samples)
        if kept is not None:
            before = kept[0] | kept[1]
            added = sum(1 for side in args._split_sides for path in side if path not in before)
            log.info("kept the resumed run's holdout: its images stay on their sides, %d added since scored", added)
        log.info("%sholding out %d%% of each class for validation (--val-split): %d of its %d images, %.0f%% (by "
                 "each image's path, so a class's share varies; a class keeps at least one on each side)", said,
                 round(100 * args.val_split), held, whole, 100 * held / max(whole, 1))
        return train_split, val_split
    _check_laid_out(args.data)
    train_split = scan_split(args.data / "train", workers=workers)
    val_split = scan_split(args.data / "val", workers=workers)
    check_same_classes(train_split, val_split)
    return train_split, val_split


def _say_batch_over_the_data(args: argparse.Namespace, images: int, env: DistEnv) -> None:
    """A warning when the global batch holds more images than the training set: every step is then the whole set,
    and a learning rate derived from the batch is a larger batch's (it went unsaid: a data scientist's trial)."""
    batch = args.batch_size * env.world_size
    if batch <= images or not env.is_main:
        return
    derived = (f"; the learning rate derived from it ({args.lr:g}) is a batch of {batch}'s: give --lr, or a smaller "
               "--batch-size" if getattr(args, "lr_from_batch", False) else "")
    log.warning("the global batch (%d) is larger than the %d training images: each step takes all of them%s", batch,
                images, derived)


def _relative(split: Split) -> frozenset[str]:
    """A split's images as paths under its folder."""
    return frozenset(path.relative_to(split.root).as_posix() for path, _ in split.samples)


def _check_laid_out(data: Path) -> None:
    """DataError saying what ``--data`` lacks when it is neither DIR/<class>/* nor DIR/train and DIR/val (before:
    "DIR/train is not a directory" for a folder that does not exist, a file, one of loose images or an empty one,
    though DIR/train was never asked for)."""
    layouts = f"{data}/<class name>/<images> (a folder a class), or {data}/train/<class name>/ and {data}/val/..."
    if not data.exists():
        raise DataError(f"--data {data} does not exist; expected {layouts}")
    if not data.is_dir():
        raise DataError(f"--data {data} is a file; give the folder that holds {layouts}")
    if (data / "train").is_dir() and not (data / "val").is_dir():
        raise DataError(f"{data} has train/ but no val/: add {data}/val/<class name>/<images>, or give --data "
                        f"{data / 'train'} to hold out part of it for validation (--val-split, "
                        f"{DEFAULT_VAL_SPLIT:g} by default)")
    if (data / "val").is_dir() and not (data / "train").is_dir():
        raise DataError(f"{data} has val/ but no train/: add {data}/train/<class name>/<images>")
    if not (data / "train").is_dir():
        raise DataError(f"{data} has no class folders: put its images in {layouts}")


def load_data(args: argparse.Namespace, preset: EvalPreset, env: DistEnv, device: torch.device) -> Data:
    """Check both splits, then build sharded loaders (every rank scans: the result is the same everywhere)."""
    train_split, val_split = splits(args)
    # what training reads under another name, or what the server refuses, is no validation of what it answers
    val_split = servable_only(without_trained(val_split, train_split))
    skipped = [*train_split.skipped, *val_split.skipped]
    if skipped and env.is_main:  # once, by rank 0: every rank scans alike
        for path, reason in skipped:
            log.warning("skipping %s (%s)", path, reason)
        log.warning("skipped %d file(s): unreadable, refused by the server or in no class folder; training on %d, "
                    "validating on %d",
                    len(skipped), len(train_split.samples), len(val_split.samples))
    if env.is_main:
        _say_class_counts(train_split, val_split)
    _say_batch_over_the_data(args, len(train_split.samples), env)
    train_set, collate_fn, prepare = _train_set(args, train_split, preset, device)
    # Validation decodes and preprocesses as the server does on the CPU (a large JPEG at reduced scale, the tensor
    # eval transform), so evaluate() scores what it serves.
    val_set = FolderDataset(val_split.samples, ServedEvalTransform(preset), served_decode=True)
    sampler = EpochSampler(train_set, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=args.seed)
    workers = {"num_workers": args.workers, "pin_memory": device.type == "cuda",
               "persistent_workers": args.workers > 0, "prefetch_factor": args.prefetch if args.workers else None}
    if len(sampler) < 2:
        raise DataError(f"{args.data / 'train'} has {len(train_set)} image(s); need at least 2 per process")
    # Each loader's own generator keeps its iterators from drawing on the global RNG (which dropout uses): a
    # loader draws a seed per iterator, and with persistent workers that is once per process, so a resumed run
    # would draw once more than an uninterrupted one and train differently.
    # A last batch of one image would break BatchNorm in training mode, so only then is it dropped.
    train = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                       drop_last=len(sampler) % args.batch_size == 1,
                       generator=torch.Generator().manual_seed(args.seed), collate_fn=collate_fn, **workers)
    val = DataLoader(val_set, batch_size=args.batch_size,
                     sampler=ShardSampler(len(val_set), env.rank, env.world_size),
                     generator=torch.Generator().manual_seed(args.seed), **workers)
    return Data(train, val, sampler, train_split.classes, [path for path, _ in val_split.samples], prepare)


CLASS_COUNTS_SHOWN = 20  # classes named with their counts in training's first lines; more: the fewest of them
FEW_TIMES_FEWER = 10  # a class with this many times fewer training images than the largest is warned of


def _say_class_counts(train: Split, val: Split) -> None:
    """Each class's images, trained on and validated on (the fewest first past CLASS_COUNTS_SHOWN), and a warning
    for a class FEW_TIMES_FEWER times smaller than the largest: the model learns to seldom answer it."""
    trained, validated = Counter(index for _, index in train.samples), Counter(index for _, index in val.samples)
    order = sorted(range(len(train.classes)), key=lambda i: (trained[i], train.classes[i]))
    shown = order if len(order) <= CLASS_COUNTS_SHOWN else order[:CLASS_COUNTS_SHOWN]
    more = f", and {len(order) - len(shown)} more classes" if len(shown) < len(order) else ""
    log.info("images a class (trained on / validated on), fewest first: %s%s",
             ", ".join(f"{train.classes[i]} {trained[i]}/{validated[i]}" for i in shown), more)
    fewest, most = order[0], order[-1]
    if trained[fewest] * FEW_TIMES_FEWER <= trained[most]:
        log.warning("class %s has %d training image(s) against %d for %s: a model trained on so few seldom answers it; "
                    "add images to it", train.classes[fewest], trained[fewest], trained[most],
                    train.classes[most])


def _train_set(args: argparse.Namespace, split: Split, preset: EvalPreset,
               device: torch.device) -> tuple[Dataset, Callable[[list[Any]], Any] | None, Prepare]:
    """The train set, its collate function and the batch preparation of the chosen data path: ``cpu`` decodes
    and augments in the workers; ``gpu`` sends encoded JPEGs and does the rest on the device (models/data/gpu.py).
    Validation always runs the server's eval transform on the CPU."""
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    if args.data_backend == "gpu":
        dataset = EncodedFolder(split.samples, min_crop_scale=args.min_crop_scale, hflip_prob=args.hflip_prob,
                                seed=args.seed)
        return dataset, collate, DeviceAugment(preset, device, memory_format)
    dataset = FolderDataset(split.samples, train_transform(preset, args.hflip_prob, args.min_crop_scale),
                            seed=args.seed)
    return dataset, None, ToDevice(device, memory_format)
