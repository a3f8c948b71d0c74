"""Real photos through a model's own eval transform, and how closely a format's answers agree with float32 on them.

The photos are scikit-image's (``skimage.data``, shipped inside the package: nothing is downloaded), split in two
sets that share no photo: int8 calibration sees one, the agreement check at export and in
``bench.serving.formats`` the other.

- calibration: 4 colour photos (astronaut, coffee, rocket, retina) and 4 grey ones as RGB (camera, coins, moon,
  brick), each whole, mirrored and as its 4 corner crops of 70%: 48 images;
- agreement: 3 colour photos (chelsea, hubble_deep_field, immunohistochemistry) and 6 grey ones (clock, cell, grass,
  gravel, page, text), each whole and as its 5 crops (4 corners and the centre) of 80% and of 60%, and all of those
  mirrored: 22 views of each of 9 photos, 198 images.

An int8 package exported from a ``models.train`` checkpoint is calibrated on its run's own images and checked on
the ones its run held out (``run_images``: from what its export records of the run, ``TrainedOn``), each whole and
mirrored, where the run's folders are still there with enough of them: scikit-image's photos say little of how a
model of other classes agrees with itself (a 4-class model agreed on 82% of them and 100% of its held-out images).

The checks' forward passes run on one thread (``one_thread``); ``Laps`` times an export's steps, its ONNX check's
among them, for the export's last log line.
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
from PIL import Image, ImageOps

from models.architectures import split_outputs
from models.export.manifest import Agreement, TrainedOn
from models.presets import EvalPreset, eval_transform
from models.run.args import DataError

CALIBRATION_PHOTOS = ("astronaut", "coffee", "rocket", "retina", "camera", "coins", "moon", "brick")
AGREEMENT_PHOTOS = ("chelsea", "hubble_deep_field", "immunohistochemistry", "clock", "cell", "grass", "gravel",
                    "page", "text")
def _photo(name: str) -> Image.Image:
    import skimage.data

    return Image.fromarray(np.asarray(getattr(skimage.data, name)())).convert("RGB")


def _crop(image: Image.Image, share: float, where: str) -> Image.Image:
    width, height = image.size
    w, h = int(width * share), int(height * share)
    left = {"l": 0, "r": width - w, "c": (width - w) // 2}[where[1]]
    top = {"t": 0, "b": height - h, "c": (height - h) // 2}[where[0]]
    return image.crop((left, top, left + w, top + h))


CORNERS = ("tl", "tr", "bl", "br")


def _calibration_views(image: Image.Image) -> Iterator[Image.Image]:
    yield image
    yield ImageOps.mirror(image)
    yield from (_crop(image, 0.7, corner) for corner in CORNERS)


def _agreement_views(image: Image.Image) -> Iterator[Image.Image]:
    crops = [image] + [_crop(image, share, where) for share in (0.8, 0.6) for where in (*CORNERS, "cc")]
    for crop in crops:
        yield crop
        yield ImageOps.mirror(crop)


def _batch(names: tuple[str, ...], views: Callable[[Image.Image], Iterator[Image.Image]],
           preset: EvalPreset) -> torch.Tensor:
    transform = eval_transform(preset)
    return torch.stack([transform(view) for name in names for view in views(_photo(name))])


def calibration_batch(preset: EvalPreset, images: "RunImages | None" = None) -> torch.Tensor:
    """The calibration images, preprocessed as the model's eval transform does (48 x C x H x W); with ``images``,
    the run's trained-on images, each whole and mirrored."""
    if images is not None:
        return _files_batch(images.calibration, preset)
    return _batch(CALIBRATION_PHOTOS, _calibration_views, preset)


def agreement_batch(preset: EvalPreset, images: "RunImages | None" = None) -> torch.Tensor:
    """The agreement images, preprocessed as the model's eval transform does (198 x C x H x W); with ``images``,
    the run's held-out images, each whole and mirrored."""
    if images is not None:
        return _files_batch(images.agreement, preset)
    return _batch(AGREEMENT_PHOTOS, _agreement_views, preset)


IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif"})
MIN_HELD_OUT = 8  # fewer held-out images than this: the photos check instead (a share of 7 says little)
MOST_CALIBRATION, MOST_AGREEMENT = 64, 200  # images of a run taken at most (evenly spread), before mirroring


@dataclass(frozen=True)
class RunImages:
    """A run's images for an int8 package: ``calibration`` trained on, ``agreement`` held out."""

    calibration: list[Path]
    agreement: list[Path]

    def __str__(self) -> str:
        return f"{len(self.agreement)} held-out images of its run, whole and mirrored"


def run_images(trained_on: TrainedOn | None) -> RunImages | None:
    """The images of a run, as its export records them (``trained_on``: write.run_trained_on): those it held out
    (the files its held_out.txt lists, read as ``models.predict`` reads a file list, or its data's val/ beside the
    train/ folder it trained on) and those it trained on; None when they are not there (moved, another machine),
    fewer than MIN_HELD_OUT are held out, or none was trained on."""
    from models.data.folder import class_files, readable
    from models.predict.inputs import read_list

    if trained_on is None:
        return None
    folder = Path(trained_on.folder)
    try:
        if trained_on.held_out is not None:
            held = [Path(item.file) for item in read_list(Path(trained_on.held_out))]
            # compared as the run wrote them (absolute paths, no file looked up): a large folder costs no stat each
            kept = {os.path.abspath(path) for path in held}
            trained = [path for path in class_files(folder) if os.path.abspath(path) not in kept]
        elif (folder.parent / "val").is_dir():
            held, trained = class_files(folder.parent / "val"), class_files(folder)
        else:
            return None
    except (OSError, DataError):  # not there, or not a folder of class folders any more
        return None
    # those chosen that are readable images (training skipped the others): a folder of none checks on the photos
    held = [path for path in _spread(_named_images(held), MOST_AGREEMENT) if readable(path)]
    trained = [path for path in _spread(_named_images(trained), MOST_CALIBRATION) if readable(path)]
    if len(held) < MIN_HELD_OUT or not trained:
        return None
    return RunImages(trained, held)


def _named_images(paths: list[Path]) -> list[Path]:
    return [path for path in paths if path.suffix.lower() in IMAGE_SUFFIXES]


def _spread(paths: list[Path], most: int) -> list[Path]:
    """At most ``most`` of ``paths``, evenly spread over them (every class of a sorted folder among them)."""
    if len(paths) <= most:
        return paths
    return [paths[i * len(paths) // most] for i in range(most)]


def _files_batch(paths: Sequence[Path], preset: EvalPreset) -> torch.Tensor:
    """``paths`` decoded as the server decodes them (unreadable ones left out), each whole and mirrored."""
    from models.data.folder import load_image

    transform, views = eval_transform(preset), []
    for path in paths:
        try:
            image = load_image(path, served_decode=True)
        except Exception:  # noqa: BLE001 - a file training skipped too: not an image, truncated
            continue
        views += [transform(image), transform(ImageOps.mirror(image))]
    return torch.stack(views)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread inside the ``with`` block (the export's checks), then the count it had.

    The checks' forward passes are small (one image, or two) and many: with 2 threads on a 2-core machine that
    other work shares, every layer waits for the thread whose core is busy. On the 2-core VM at a load of 7 to 10,
    Lite0's eager forward pass of one image took 1.2-2.5 s on 2 threads against 0.09-0.13 s on one, and
    preprocessing the 198 agreement photos 10-20 s against 1.5-2.2 s; with the machine idle a second thread made
    one image's decode and forward pass only 1-2.5% faster (docs/performance.md).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class Laps:
    """How long each step of an export took: seconds by step name, in the order the steps ended, written as
    "name 1.2s, ..."."""

    def __init__(self, since: float | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter() if since is None else since  # a time.perf_counter() reading

    def done(self, step: str) -> None:
        """Record ``step`` as ended now: the time since the previous step ended (or since the laps began)."""
        now = time.perf_counter()
        self.seconds[step] = self.seconds.get(step, 0.0) + now - self._last
        self._last = now

    def __str__(self) -> str:
        return ", ".join(f"{step} {seconds:.1f}s" for step, seconds in self.seconds.items())


Answers = tuple[torch.Tensor, "torch.Tensor | None"]  # float32 probabilities and embeddings (None: the model has none)


def answers(forward: Callable[[torch.Tensor], object], images: torch.Tensor, batch_size: int = 8) -> Answers:
    """Softmax of ``forward`` over ``images``, ``batch_size`` at a time, as float32, and its embeddings when it
    answers them (models/architectures.split_outputs)."""
    probabilities, embeddings = [], []
    with torch.inference_mode():
        for chunk in images.split(batch_size):
            logits, embedding = split_outputs(forward(chunk))  # type: ignore[arg-type]
            probabilities.append(logits.float().softmax(dim=1))
            if embedding is not None:
                embeddings.append(embedding.float())
    return torch.cat(probabilities), (torch.cat(embeddings) if embeddings else None)


def probabilities(forward: Callable[[torch.Tensor], object], images: torch.Tensor,
                  batch_size: int = 8) -> torch.Tensor:
    """Softmax of ``forward`` over ``images``, ``batch_size`` at a time, as float32."""
    return answers(forward, images, batch_size)[0]


def agreement(reference: Answers, candidate: Answers) -> Agreement:
    """How ``candidate``'s probabilities (both images x classes), and embeddings when both have them, agree with
    ``reference``'s."""
    (expected, expected_embedding), (got, got_embedding) = reference, candidate
    same = (expected.argmax(dim=1) == got.argmax(dim=1)).float().mean()
    cosine = None
    if expected_embedding is not None and got_embedding is not None:
        cosine = round(float(torch.nn.functional.cosine_similarity(expected_embedding, got_embedding).min()), 4)
    return Agreement(photos=expected.shape[0], top1=round(float(same), 4),
                     max_probability_difference=round(float((expected - got).abs().max()), 4),
                     min_embedding_cosine=cosine)
