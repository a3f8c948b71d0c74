"""Image folders for training: ``DIR/train/<class>/*`` and ``DIR/val/<class>/*``, checked before training starts."""
from __future__ import annotations

import hashlib
import os
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence, Union

import torch
from PIL import Image
from torch.utils.data import Dataset, DistributedSampler, Sampler

from models.export.manifest import MIN_LABELS
from models.image_decode import DecodeLimits, ImageRefused, load_upright, open_checked
from models.predict.inputs import folder_files
from models.presets import IMAGE_FORMATS, ImageTransform, upright_rgb
from models.run.args import DataError


SERVED_LIMITS = DecodeLimits()  # the server's defaults: its reduced-scale JPEG decode (JPEG_DRAFT_MIN_SIDE)

Sample = tuple[Path, int]
# A training sample is addressed as (epoch, index) so that its augmentation can be seeded from both.
SampleKey = Union[int, tuple[int, int]]


@dataclass(frozen=True)
class Split:
    """One split of an image folder: class names in index order, readable samples, and what was skipped."""

    root: Path
    classes: list[str]
    samples: list[Sample]
    skipped: list[tuple[Path, str]]


def _unreadable_reason(path: Path) -> str | None:
    """None when PIL decodes the file in a format the server accepts; else why not."""
    try:
        with Image.open(path) as image:
            if image.format not in IMAGE_FORMATS:
                return f"format {image.format} is not one the server accepts"
            # A reduced-scale JPEG decode still reads the whole file, so truncation shows, at a fraction of the cost.
            image.draft("RGB", (64, 64))
            image.load()
    except Exception as exc:  # noqa: BLE001 - PIL raises many types on broken files
        return f"{type(exc).__name__}: {exc}"
    return None


def readable(path: Path) -> bool:
    """Whether ``path`` is an image training takes (``_unreadable_reason``: a format the server accepts, whole)."""
    return _unreadable_reason(path) is None


def _class_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        raise DataError(f"{root} is not a directory; expected {root}/<class name>/<images>")
    dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not dirs:
        raise DataError(f"{root} has no class folders; expected {root}/<class name>/<images>")
    if len(dirs) < MIN_LABELS:  # its model would answer 1.0 for every image; the export would refuse it anyway
        raise DataError(f"{root} has one class folder ({dirs[0].name}); a classifier needs at least {MIN_LABELS} "
                        f"classes: add a folder of the images that are not {dirs[0].name} (e.g. {root}/other)")
    _names_told_apart(root, [d.name for d in dirs])
    return dirs


def _names_told_apart(root: Path, names: list[str]) -> None:
    """DataError for two class folders whose names are the same text in two Unicode forms (an accent composed, as
    most systems write it, or decomposed, as macOS's file names have it): each would be a class of its own, both
    answered by the same label."""
    seen: dict[str, str] = {}
    for name in names:
        same = seen.setdefault(unicodedata.normalize("NFC", name), name)
        if same != name:
            raise DataError(f"class folders {same!r} and {name!r} in {root} are the same name written in two Unicode "
                            "forms (an accent composed and decomposed): they would train as two classes answered by "
                            "one label; move their images into one folder")


def in_another_form(names: Iterable[str], reference: Iterable[str]) -> dict[str, str]:
    """Each of ``names`` that is one of ``reference``'s names written in another Unicode form (an accent composed in
    one, decomposed in the other, as macOS's file names have it), with that name: the two read alike, so a list of
    the names that differ would not say why."""
    known = {unicodedata.normalize("NFC", name): name for name in reference}
    return {name: known[text] for name in names if (text := unicodedata.normalize("NFC", name)) in known}


def loose_files(root: Path) -> list[tuple[Path, str]]:
    """The files directly in ``root``, in no class folder (hidden ones aside), each with why training leaves it
    out: a stray photo there is most often one misfiled, which would otherwise go unsaid."""
    return [(path, f"in no class folder: training reads {root}/<class name>/<images>")
            for path in sorted(root.iterdir()) if path.is_file() and not path.name.startswith(".")]


def _files(class_dir: Path) -> list[Path]:
    """The files under a class folder (itself a link or not), hidden ones and those in hidden folders (a NAS's
    .@__thumb thumbnails, .git) left out and links to folders in it not followed, as models.predict's scan reads a
    class folder (``folder_files``)."""
    return sorted(Path(entry.path) for _, _, files in folder_files(str(class_dir), links=False)
                  for entry in files if os.path.isfile(entry.path) or _broken_link(entry.path))


def _broken_link(path: str) -> bool:
    """A link whose target is gone: listed, so that the scan skips it saying why (as models.predict does), not
    left out unsaid."""
    return os.path.islink(path) and not os.path.exists(path)


def class_files(root: Path) -> list[Path]:
    """Every file under ``root/<class>/`` (symbolic links to class folders followed), unchecked; DataError for a
    layout that is not one."""
    return [path for class_dir in _class_dirs(root) for path in _files(class_dir)]


def scan_split(root: Path, workers: int = 4) -> Split:
    """List and decode-check every file under ``root/<class>/``; raise DataError for layouts we cannot train on."""
    class_dirs = _class_dirs(root)
    candidates = [(path, index) for index, class_dir in enumerate(class_dirs) for path in _files(class_dir)]
    # PIL releases the GIL while decoding, so threads check files in parallel.
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        reasons = list(pool.map(_unreadable_reason, [path for path, _ in candidates]))
    samples, linked = _one_name_each([sample for sample, reason in zip(candidates, reasons) if reason is None])
    skipped = [*loose_files(root), *((path, reason) for (path, _), reason in zip(candidates, reasons)
                                     if reason is not None), *linked]
    counts = [0] * len(class_dirs)
    for _, index in samples:
        counts[index] += 1
    empty = [class_dir.name for class_dir, count in zip(class_dirs, counts) if count == 0]
    if empty:
        raise DataError(f"class folder(s) with no readable images in {root}: {', '.join(empty)}")
    return Split(root=root, classes=[d.name for d in class_dirs], samples=samples, skipped=skipped)


def _one_name_each(samples: list[Sample], read: dict[str, Path] | None = None,
                   why: str = "read once, under that name") -> tuple[list[Sample], list[tuple[Path, str]]]:
    """``samples`` with each file reached under several names (links) kept under its own name (else its first
    link, in class and path order), the others skipped saying which file they are: a file linked into another class
    would train under two labels, and one linked across a hold-out would be validated on after training on it;
    ``read``: files (by real path) already taken elsewhere, whose names here are all skipped."""
    seen, kept, skipped = dict(read or {}), [], []
    # a file under its own name before the links to it (those in an earlier class too), each in order
    for path, index in sorted(samples, key=lambda sample: os.path.islink(sample[0])):
        first = seen.setdefault(os.path.realpath(path), path)
        if first == path:
            kept.append((path, index))
        else:
            skipped.append((path, f"the same file as {first} (a link): {why}"))
    order = {sample: place for place, sample in enumerate(samples)}
    return sorted(kept, key=order.__getitem__), skipped


def without_trained(val: Split, train: Split) -> Split:
    """A validation split without the files its training split reads too, under any name (links): validation
    never scores what training read."""
    kept, skipped = _one_name_each(val.samples, {os.path.realpath(path): path for path, _ in train.samples},
                                   "training reads it, so validation leaves it out")
    return Split(val.root, val.classes, kept, [*val.skipped, *skipped])


def _refused_by_the_server(path: Path) -> str | None:
    """Why the server refuses the image at ``path`` from its header (its default limits: pixels, aspect ratio, a
    progressive JPEG's scans), or None."""
    try:
        open_checked(path.read_bytes(), SERVED_LIMITS).close()
    except ImageRefused as exc:
        return f"{exc}: the server refuses it, so validation leaves it out"
    except Exception:  # noqa: BLE001 - read whole by the scan a moment ago: judged there
        return None
    return None


def servable_only(split: Split) -> Split:
    """A validation split without the images the server refuses (for their size, or a progressive JPEG's scans;
    added to its skipped ones): they would count in the run's figures and never in what it answers; DataError where
    that leaves a class without an image, as for a class folder with none readable. Training keeps them (a
    48-megapixel photo trains as any other: resized, as the server would resize one it took)."""
    reasons = [_refused_by_the_server(path) for path, _ in split.samples]
    kept = [sample for sample, why in zip(split.samples, reasons) if why is None]
    left = {index for _, index in kept}
    empty = [name for index, name in enumerate(split.classes) if index not in left]
    if empty:
        raise DataError(f"class folder(s) in {split.root} with no image the server takes (each refused for its size "
                        f"or its scans: they would never be answered): {', '.join(empty)}")
    return Split(split.root, split.classes, kept,
                 [*split.skipped, *((path, why) for (path, _), why in zip(split.samples, reasons) if why is not None)])


def check_same_classes(train: Split, val: Split) -> None:
    """Train and val must name the same classes, or the labels would mean different things."""
    if train.classes == val.classes:
        return
    only_train = sorted(set(train.classes) - set(val.classes))
    only_val = sorted(set(val.classes) - set(train.classes))
    forms = sorted(in_another_form(only_train, only_val))
    if forms:  # (as one split's two folders of one name are told: the same text, so the lists alone read alike)
        raise DataError(f"train and val name class(es) {forms} in two Unicode forms (an accent composed in one, "
                        "decomposed in the other, as macOS's file names have it): rename one split's folders so both "
                        "write them alike")
    raise DataError(f"train and val have different classes: only in train: {only_train or '-'}; "
                    f"only in val: {only_val or '-'}")


HOLDOUT_RULE = "path-hash"  # how split_holdout decides an image's side: checkpoints record it (--resume checks)


def held_out_score(relative: str, seed: int) -> float:
    """An image's place in [0, 1) for the holdout, from its path under the folder and the seed alone: adding or
    removing other images never moves it."""
    digest = hashlib.sha256(f"{seed}\0{relative}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def split_holdout(split: Split, fraction: float, seed: int,
                  kept: tuple[frozenset[str], frozenset[str]] | None = None) -> tuple[Split, Split]:
    """Split one folder into train and val: an image is held out when its score (:func:`held_out_score` of its
    path under the folder and the seed) is below ``fraction``, so about ``fraction`` of each class is held out. A
    class keeps at least one image on each side: the lowest score held out, or the highest trained on, where none
    was. ``kept``: the (held out, trained on) paths under the folder of a run this one resumes, which keep their
    sides (images added since are scored, and alone move to give a class its one on each side), so a resumed run
    never validates on what it trained on, nor trains on what it validated on, whatever was added or removed (the
    one-on-each-side rule alone moved a trained image into validation when an image was added or removed: a data
    scientist's trial); DataError when a class has none left on a side and no new image to put there."""
    if not 0 < fraction < 1:
        raise DataError(f"--val-split must be between 0 and 1, got {fraction}")
    train: list[Sample] = []
    val: list[Sample] = []
    for index, name in enumerate(split.classes):
        files = sorted(path for path, target in split.samples if target == index)
        if len(files) < 2:
            raise DataError(f"class {name!r} ({split.root / name}) has {len(files)} readable image(s); holding out "
                            f"a share for validation (--val-split) needs at least 2 a class, one on each side: add "
                            f"images to it, or remove the folder")
        scored = sorted((held_out_score(path.relative_to(split.root).as_posix(), seed), path) for path in files)
        if kept is None:
            ranked = [path for _, path in scored]
            held = min(max(1, sum(score < fraction for score, _ in scored)), len(files) - 1)
            val += [(path, index) for path in sorted(ranked[:held])]
            train += [(path, index) for path in sorted(ranked[held:])]
            continue
        its_val, its_train = _kept_sides(split.root / name, scored, fraction, kept)
        val += [(path, index) for path in its_val]
        train += [(path, index) for path in its_train]
    return (Split(root=split.root, classes=split.classes, samples=train, skipped=split.skipped),
            Split(root=split.root, classes=split.classes, samples=val, skipped=[]))


def _kept_sides(folder: Path, scored: list[tuple[float, Path]], fraction: float,
                kept: tuple[frozenset[str], frozenset[str]]) -> tuple[list[Path], list[Path]]:
    """One class's (val, train) of a resumed run: its images on the sides the run kept them, those added since by
    their scores; a new image moved to a side left empty (the lowest score to val, the highest to train)."""
    root = folder.parent
    held_before, trained_before = kept
    val, train, new_val, new_train = [], [], [], []
    for score, path in scored:
        relative = path.relative_to(root).as_posix()
        if relative in held_before:
            val.append(path)
        elif relative in trained_before:
            train.append(path)
        else:
            (new_val if score < fraction else new_train).append(path)
    if not val and not new_val:
        if not new_train:
            raise DataError(f"class {folder.name!r} has no image left of those the resumed run held out for "
                            f"validation, and none added to hold out: add an image to {folder} (an image added is "
                            f"held out), or train afresh into another --output-dir")
        new_val.append(new_train.pop(0))  # the lowest score
    if not train and not new_train:
        if not new_val:
            raise DataError(f"class {folder.name!r} has no image left of those the resumed run trained on, and none "
                            f"added to train on: add an image to {folder}, or train afresh into another --output-dir")
        new_train.append(new_val.pop())  # the highest score
    return sorted(val + new_val), sorted(train + new_train)


def load_image(path: Path, *, served_decode: bool = False) -> Image.Image:
    """Read one file, upright by EXIF, RGB: fully decoded (training's crops), or with ``served_decode`` as the
    server decodes an upload (models/image_decode.py ``load_upright``: a large JPEG at libjpeg's reduced scale, the
    default JPEG_DRAFT_MIN_SIDE), so validation sees the pixels the served model sees."""
    with Image.open(path) as image:
        if served_decode:
            return load_upright(image, SERVED_LIMITS)
        image.load()
        return upright_rgb(image)


class UnreadableImage(DataError):
    """An image that was readable when the run checked it and is not now (replaced, truncated or removed while the
    run trains): one line naming it. Raised in a DataLoader worker, it reaches the training loop rebuilt from its
    text with the worker's traceback before it (torch's ExceptionWrapper): only its own line is kept."""

    def __init__(self, message: str) -> None:
        super().__init__(message.strip().rsplit(f"{type(self).__name__}: ", 1)[-1])


def read_sample(path: Path, *, served_decode: bool = False) -> Image.Image:
    """:func:`load_image`, a failure raised as UnreadableImage naming the file. It stops the run rather than skipping
    the file: a sample dropped mid-epoch changes the batches (a resumed run would no longer train as an
    uninterrupted one) and under DDP one rank's shorter epoch would wait forever for the others."""
    try:
        return load_image(path, served_decode=served_decode)
    except Exception as exc:  # noqa: BLE001 - PIL raises many types on broken files; OSError on a missing one
        raise unreadable(path, exc) from None


def unreadable(path: Path, exc: BaseException) -> UnreadableImage:
    """The UnreadableImage of a sample whose read failed with ``exc`` (both data paths')."""
    reason = (str(exc).strip().splitlines() or [""])[0]
    return UnreadableImage(f"{path} became unreadable after the run checked it ({type(exc).__name__}: {reason}): "
                           f"replace or remove it, then go on with --resume")


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one sample's augmentation in one epoch (both data paths draw from it)."""
    return (seed * 1_000_003 + epoch) * 10_000_019 + index


class FolderDataset(Dataset):
    """Samples of one split through a transform; augmentation is seeded per (seed, epoch, index).

    Seeding per sample makes a run reproducible whatever the number of DataLoader workers or DDP ranks, and a
    resumed run sees exactly the augmentations an uninterrupted one would have.
    """

    def __init__(self, samples: Sequence[Sample], transform: ImageTransform, seed: int = 0, *,
                 served_decode: bool = False) -> None:
        self.samples = list(samples)
        self.transform = transform
        self.seed = seed
        self.served_decode = served_decode  # validation's: decoded as the server decodes (load_image)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key: SampleKey) -> tuple[torch.Tensor, int]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        path, target = self.samples[index]
        image = read_sample(path, served_decode=self.served_decode)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed(self.seed, epoch, index))
            return self.transform(image), target


class EpochSampler(DistributedSampler):
    """torch's DistributedSampler (shard, shuffle by seed + epoch, ``set_epoch``), yielding (epoch, index) keys."""

    def __iter__(self) -> Iterator[tuple[int, int]]:  # type: ignore[override]
        epoch = self.epoch
        return ((epoch, index) for index in super().__iter__())


class ShardSampler(Sampler[int]):
    """Every ``world_size``-th index from ``rank``, in order and without padding: exact metrics once reduced."""

    def __init__(self, length: int, rank: int, world_size: int) -> None:
        self.indices = list(range(rank, length, world_size))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
