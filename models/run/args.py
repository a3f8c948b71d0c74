"""What the user gives ``python -m models.train``: its options (kept apart so the training loop stays readable), and
``DataError`` for what of it cannot work (options, data, a checkpoint to resume)."""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Callable, Sequence

from models.commands import python_command


class DataError(ValueError):
    """A mistake in the dataset (or options) the user gave us: reported as one clear line, never a traceback."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` with each option's default (ArgumentDefaultsHelpFormatter's, without the empty ones: None and
    a flag's False, nor twice where the help already says it), and the description as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.default is None or action.default is False or action.default is argparse.SUPPRESS
                or not action.option_strings or "default" in text):
            return text
        return f"{text} (default: %(default)s)".lstrip()


DEFAULT_OUTPUT_DIR = Path("runs/default")


class _Parser(argparse.ArgumentParser):
    """Resolves the defaults that follow other options, for every caller of the parser."""

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        parsed, rest = super().parse_known_args(args, namespace)
        if parsed.resume is None and parsed.data is None:
            self.error("the following arguments are required: --data (or --resume of a run's checkpoint)")
        # the options the command line gives: a resumed run takes its checkpoint's for the others of its run's own
        # (models/run/checkpoint.py resumed_run), not their defaults (an --opt, --lr or --data it never had)
        parsed._given = self._given(args) if parsed.resume is not None else frozenset()
        if parsed.arch is None:  # --pretrained exists for efficientnet_lite0 only
            parsed.arch = "efficientnet_lite0" if parsed.pretrained else "resnet18"
        if parsed.output_dir is None:  # a resumed run goes on in its checkpoint's folder, as its hints say (another
            # file of it, best.pt or a copy, would write over the run's later epochs there: it branches instead)
            resumes_its_run = parsed.resume is not None and parsed.resume.name == "checkpoint.pt"
            parsed.output_dir = parsed.resume.parent if resumes_its_run else DEFAULT_OUTPUT_DIR
        return parsed, rest

    def _given(self, args: Sequence[str] | None) -> frozenset[str]:
        """The options ``args`` give (their dests), whatever their values: parsed again without defaults."""
        defaults = [(action, action.default) for action in self._actions]
        try:
            for action, _ in defaults:
                action.default = argparse.SUPPRESS
            given, _ = super().parse_known_args(args, None)
        finally:
            for action, default in defaults:
                action.default = default
        return frozenset(vars(given))


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _number(low: float = 0.0, high: float = math.inf, *, low_open: bool = False,
            high_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite float from ``low`` to ``high`` (an open end excluded), refused before the data is
    scanned, with the range in the error (a negative --lr or a --label-smoothing of 1.5 failed as a traceback deep
    in torch, or trained on silently)."""
    if high == math.inf:
        span = f"above {low:g}" if low_open else f"{low:g} or more"
    else:
        span = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def number(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text}") from None
        if not (math.isfinite(value) and low <= value <= high) or (low_open and value == low) or (
                high_open and value == high):
            raise argparse.ArgumentTypeError(f"must be {span}, got {text}")
        return value

    return number


LIBRARIES = ("timm", "torchvision")  # models/architectures.py's LIBRARIES, by name: this module imports no torch
# (models.neighbours' command runs without it; a test keeps the two the same)
_LIBRARY_ARCHS = " or ".join(f"{library}:NAME" for library in LIBRARIES)  # how --arch names a library's model


def _arch(archs: Sequence[str]) -> Callable[[str], str]:
    """An argparse type: one of ``archs``, or ``LIBRARY:NAME`` of one of LIBRARIES (whether that library has such a
    model is checked once it is imported: models.train's set-up)."""
    def arch(text: str) -> str:
        library, _, name = text.partition(":")
        if text in archs or (library in LIBRARIES and name):
            return text
        raise argparse.ArgumentTypeError(f"{text!r}: choose one of {', '.join(archs)}, or {_LIBRARY_ARCHS} for "
                                         "another model of those libraries")
    return arch


_PROBABILITY = _number(0, 1)
_FRACTION = _number(0, 1, low_open=True, high_open=True)  # of a folder held out: both sides keep images
_POSITIVE = _number(low_open=True)


def get_args_parser(archs: Sequence[str], description: str = "") -> argparse.ArgumentParser:
    """Options in torchvision's reference-script spirit; sizes default to the arch's pretrained preset."""
    parser = _Parser(prog=f"{python_command()} -m models.train", description=description,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--data", type=Path, default=None,
                        help="folder of <class>/* (about 20%% of each class held out for validation: "
                             "--val-split), or with train/<class>/* and val/<class>/* (with --resume: the run's)")
    parser.add_argument("--val-split", type=_FRACTION, default=None,
                        help="hold out about this fraction of each class of a DIR/<class>/* folder for validation "
                             "(each image by its path and --split-seed: added images move none; default for such a "
                             "folder: 0.2)")
    parser.add_argument("--arch", type=_arch(archs), default=None, metavar="ARCH",
                        help=f"the network: {', '.join(archs)}, or any other model of {' or '.join(LIBRARIES)} as "
                             f"{_LIBRARY_ARCHS} (e.g. timm:resnet34, torchvision:efficientnet_b0) "
                             "(default: efficientnet_lite0 with --pretrained, resnet18 without)")
    parser.add_argument("--pretrained", action=argparse.BooleanOptionalAction, default=False,
                        help="start from the packaged ImageNet weights (new head); efficientnet_lite0 only")
    parser.add_argument("--weights", type=Path, default=None, metavar="FILE",
                        help="start from these weights of --arch: a state dict (torch.save(model.state_dict(), "
                             "FILE), also nested or DDP-named), an export (its folder or its state dict) or a "
                             "models.train checkpoint; every layer but the head, which is new, one output a class of "
                             "this data")
    parser.add_argument("--mean", type=_number(0, 1), nargs=3, default=None, metavar=("R", "G", "B"),
                        help="the normalisation's mean on 0..1 pixels, as the --weights were trained with (default: "
                             "the export's or the run's whose --weights they are, else ImageNet's 0.485 0.456 0.406)")
    parser.add_argument("--std", type=_number(0, 1, low_open=True), nargs=3, default=None, metavar=("R", "G", "B"),
                        help="the normalisation's standard deviation on 0..1 pixels (default: as --mean's, else "
                             "ImageNet's 0.229 0.224 0.225)")
    parser.add_argument("--freeze-backbone", action=argparse.BooleanOptionalAction, default=False,
                        help="train the new head only")
    parser.add_argument("--backbone-lr-scale", type=_number(), default=1.0,
                        help="backbone learning rate = lr x this (e.g. 0.1 when fine-tuning)")
    parser.add_argument("--epochs", type=_positive_int, default=10, help="passes over the training set")
    parser.add_argument("--batch-size", type=_positive_int, default=32, help="images per process and step")
    parser.add_argument("--opt", choices=("sgd", "adamw"), default="sgd", help="optimiser")
    parser.add_argument("--lr", type=_POSITIVE, default=None,
                        help="peak learning rate (default: SGD 0.1 x global batch / 256, the linear scaling rule; "
                             "AdamW 0.001)")
    parser.add_argument("--momentum", type=_number(0, 1, high_open=True), default=0.9, help="SGD momentum")
    parser.add_argument("--weight-decay", type=_number(), default=1e-4, help="L2 penalty (AdamW: decoupled)")
    parser.add_argument("--label-smoothing", type=_number(0, 1, high_open=True), default=0.0,
                        help="cross-entropy label smoothing")
    parser.add_argument("--lr-warmup-epochs", type=_non_negative_int, default=None,
                        help="linear warm-up (default: 1 epoch from scratch, 0 with --pretrained or --weights)")
    parser.add_argument("--clip-grad-norm", type=_number(), default=None,
                        help="clip the gradient norm to this (0: no clipping, as without it)")
    parser.add_argument("--amp", action=argparse.BooleanOptionalAction, default=False,
                        help="mixed precision (autocast) for training")
    parser.add_argument("--amp-dtype", choices=("bf16", "fp16"), default=None,
                        help="with --amp: bf16 (the default) or fp16 (CUDA; with a GradScaler)")
    parser.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=True,
                        help="TF32 tensor cores for the fp32 matmuls and convolutions on CUDA (Ampere and later)")
    parser.add_argument("--channels-last", action="store_true", help="NHWC memory format (faster convs on GPUs)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the model for training (a minute or more of compiling first)")
    parser.add_argument("--freeze-bn", action=argparse.BooleanOptionalAction, default=False,
                        help="keep BatchNorm running statistics fixed")
    parser.add_argument("--bn-recompute-batches", type=_non_negative_int, default=100,
                        help="after each epoch, recompute BatchNorm's statistics for the epoch's final weights from "
                             "this many training batches (0: keep the running averages)")
    parser.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm across DDP ranks (CUDA)")
    parser.add_argument("--resize-size", type=_positive_int, default=None, help="eval resize (default 256)")
    parser.add_argument("--crop-size", type=_positive_int, default=None, help="input size (default 224)")
    parser.add_argument("--interpolation", choices=("nearest", "bilinear", "bicubic", "lanczos"), default=None,
                        help="resize interpolation (default: the preset's, bilinear from scratch)")
    parser.add_argument("--hflip-prob", type=_PROBABILITY, default=0.5, help="0 for digits and text")
    parser.add_argument("--min-crop-scale", type=_number(0, 1, low_open=True), default=0.08,
                        help="smallest random crop, as area fraction")
    parser.add_argument("--data-backend", choices=("cpu", "gpu"), default="cpu",
                        help="where training images are decoded and augmented: cpu (PIL in the DataLoader workers) "
                             "or gpu (workers read JPEG bytes; nvJPEG decoding, crop, flip and normalisation on the "
                             "device, batch by batch; other formats are decoded in the workers)")
    parser.add_argument("--workers", type=_non_negative_int, default=2, help="DataLoader worker processes")
    parser.add_argument("--prefetch", type=_positive_int, default=4, help="batches each worker loads ahead")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: CUDA when there is a GPU (the local rank's under torchrun)")
    parser.add_argument("--seed", type=int, default=0, help="weights, shuffling and augmentation")
    parser.add_argument("--split-seed", type=int, default=0,
                        help="which images --val-split holds out, apart from --seed: runs of other seeds (a model's "
                             "next version) validate on the same images")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help=f"checkpoints, metrics.jsonl, confusion.json (default: {DEFAULT_OUTPUT_DIR}, or with "
                             "--resume of a run's checkpoint.pt that run's folder)")
    parser.add_argument("--resume", type=Path, default=None,
                        help="checkpoint.pt to continue from, with the run's own options where not given (its data, "
                             "network, optimiser, rates, sizes, epochs, seeds); where and how it runs as given now")
    parser.add_argument("--export", type=Path, default=None, help="at the end, export best.pt to this weights dir")
    parser.add_argument("--export-repository", type=Path, default=None,
                        help="at the end, export best.pt as the next version in this model repository")
    parser.add_argument("--name", default=None,
                        help="model name in the manifest (default: the output dir's name); a new version of an "
                             "existing model in --export-repository needs that model's name")
    parser.add_argument("--plot", action="store_true", help="at the end, draw the curves to curves.png")
    return parser
