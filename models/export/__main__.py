"""Write a model into a weights directory: TorchScript file, state dict and ``manifest.json``.

    .venv/bin/python -m models.export --default --out weights                          # the bundled Lite0 (ImageNet)
    .venv/bin/python -m models.export --checkpoint runs/NAME/best.pt --out runs/NAME/export   # a models.train run's
    .venv/bin/python -m models.export --checkpoint runs/NAME/best.pt --repository repository   # NAME/<next number>/
    .venv/bin/python -m models.export --state-dict mine.pt --arch resnet18 --labels labels.txt --name mine --out DIR
    .venv/bin/python -m models.export --torchscript mine.ts --labels labels.txt --crop-size 160 --mean 0.5 0.5 0.5 \\
        --std 0.5 0.5 0.5 --name mine --repository repository --packages none     # a model trained elsewhere

An export never replaces one already written: into a folder that holds an export it refuses unless --force. With
--checkpoint and no --out it writes the run's own export/ (never weights/ unasked). Each export is written into a hidden folder
beside its target and moved there complete, so a server reading the target never finds half of one.
"""
from __future__ import annotations

import time

STARTED = time.perf_counter()  # before torch's import: the command's start, the first step it times

import argparse
import importlib.util
import logging
import shutil
import sys
from pathlib import Path
from typing import Sequence

import pydantic
import torch

from models.commands import python_command
from models.export.agreement import Laps
from models.export.compile import DTYPES, cannot_compile
from models.export.quantize import TORCHAO_HINT
from models.run.args import HelpFormatter
from models.architectures import ARCHS
from models.export.brought import brought_preset, read_labels
from models.export.checks import ModelLoadError, invalid_because
from models.export.write import export_brought, export_checkpoint, export_default, one_line

log = logging.getLogger("models.export")


def get_args_parser() -> argparse.ArgumentParser:
    """Command-line options of the exporter."""
    parser = argparse.ArgumentParser(prog=f"{python_command()} -m models.export", description=__doc__,
                                     formatter_class=HelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--default", action="store_true", help="export the bundled EfficientNet-Lite0 (ImageNet)")
    source.add_argument("--checkpoint", type=Path, help="a checkpoint written by models.train (e.g. best.pt)")
    source.add_argument("--state-dict", type=Path, help="a model trained elsewhere: its weights, as "
                        "torch.save(model.state_dict(), FILE) wrote them, of --arch; with --labels and how its "
                        "pictures were prepared (--resize-size, --crop-size, --interpolation, --mean, --std)")
    source.add_argument("--torchscript", type=Path, help="a model trained elsewhere, as a TorchScript file "
                        "(torch.jit.save's), with --labels and its preparation as for --state-dict; exported as "
                        "TorchScript alone (--packages none)")
    brought = parser.add_argument_group("a model trained elsewhere (--state-dict, --torchscript)")
    brought.add_argument("--arch", help="the architecture of a --state-dict: " + ", ".join(ARCHS) + ", or any "
                         "other of timm or torchvision as timm:NAME or torchvision:NAME (e.g. "
                         "timm:mobilenetv3_small_100, torchvision:resnet34)")
    brought.add_argument("--labels", type=Path, help="a text file of the class names, one a line, in the order of "
                         "the model's outputs")
    brought.add_argument("--resize-size", type=int, default=None, help="the short side's size before the centre "
                         "crop (default: 256, or the crop in that proportion)")
    brought.add_argument("--crop-size", type=int, default=None, help="the centre square the model sees (default 224)")
    brought.add_argument("--interpolation", choices=["nearest", "bilinear", "bicubic", "lanczos"], default=None,
                         help="the resize's (default bilinear, torchvision's)")
    brought.add_argument("--mean", type=float, nargs=3, default=None, metavar=("R", "G", "B"),
                         help="the normalisation's mean on 0..1 pixels (default ImageNet's 0.485 0.456 0.406)")
    brought.add_argument("--std", type=float, nargs=3, default=None, metavar=("R", "G", "B"),
                         help="and its standard deviation (default ImageNet's 0.229 0.224 0.225)")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--out", type=Path, default=None,
                        help="weights directory to write (when neither --out nor --repository is given: with "
                             "--checkpoint its run's export/, runs/NAME/export; else weights, the bundled model's)")
    target.add_argument("--repository", type=Path, default=None,
                        help="a model repository: writes <repository>/<name>/<version>, the next version number "
                             "unless --version says")
    parser.add_argument("--name", default=None, help="model name (a checkpoint's: its run's folder name; "
                        "--default's: efficientnet_lite0)")
    parser.add_argument("--version", default=None,
                        help="model version (in a repository: the next number; with --out: --default 1, a "
                             "checkpoint its date and a digest of its weights)")
    parser.add_argument("--force", action="store_true", help="replace an export already in the target folder")
    parser.add_argument("--packages", default="auto",
                        help="what to build beside TorchScript, comma-separated: onnx (ONNX for ONNX Runtime, what "
                             "the server serves on a CPU; seconds to minutes, by model size, cores and load), cpu, "
                             "cuda (AOTInductor packages, need g++, cuda a GPU; about 30 s each), cpu-int8 (int8 "
                             "for the CPU: PT2E quantization calibrated on real photos, needs torchao and g++), "
                             "none; auto: onnx, and cuda when a GPU is present. Agreement "
                             "with float32 on real photos goes into the manifest")
    parser.add_argument("--package-dtype", default="float32", choices=sorted(DTYPES),
                        help="the dtype of the CUDA package: the server's VISIONSERVE_DTYPE (CPU packages: float32)")
    return parser


def package_targets(packages: str, cuda_dtype: str) -> list[tuple[str, str]]:
    """``--packages`` as (device, dtype) pairs; ``("onnx", "float32")`` is the ONNX file. A package this machine
    cannot compile (CUDA without a GPU, any without a C++ compiler) is refused here, before anything is written
    (ValueError): found at its compile, it failed an export half way."""
    if packages == "none":
        return []
    if packages == "auto":  # what the server serves by default: ONNX on a CPU, a CUDA package on a GPU
        devices = ["onnx"]
        if torch.cuda.is_available() and (shutil.which("g++") or shutil.which("c++")):
            devices.append("cuda")
        elif torch.cuda.is_available():
            log.warning("no C++ compiler (g++): no CUDA AOTInductor package; the server will serve TorchScript")
    else:
        devices = packages.split(",")
    dtypes = {"cpu": "float32", "cuda": cuda_dtype, "cpu-int8": "int8", "onnx": "float32"}
    unknown = set(devices) - set(dtypes)
    if unknown:
        raise ValueError(f"--packages takes onnx, cpu, cuda, cpu-int8 (comma-separated), none or auto, "
                         f"got {packages!r}")
    if "cpu-int8" in devices and importlib.util.find_spec("torchao") is None:
        raise ValueError(TORCHAO_HINT)
    for device in devices:
        problem = cannot_compile(device.removesuffix("-int8")) if device != "onnx" else None
        if problem:
            raise ValueError(f"--packages {device}: {problem}; leave it out (onnx needs neither)")
    return [(device.removesuffix("-int8"), dtypes[device]) for device in devices]


RUN_METRICS = "metrics.jsonl"  # models/run/report.py's METRICS_NAME (a test keeps them equal; importing it would make
# the training's report code part of what the default export runs, and its every change a new export: the Makefile)


def run_export(checkpoint: Path) -> Path:
    """Where a checkpoint's export goes without --out: its run's export/ (runs/NAME/best.pt: runs/NAME/export);
    ValueError for a checkpoint that is not in a run's folder (/tmp/best.pt would write /tmp/export)."""
    if not (checkpoint.parent / RUN_METRICS).is_file():
        raise ValueError(f"{checkpoint} is not in a models.train run's folder (no {RUN_METRICS} beside it): name the "
                         f"folder to export into, --out DIR")
    return checkpoint.parent / "export"


# What describes a model trained elsewhere, by its option: a checkpoint and the bundled model carry their own
BROUGHT_OPTIONS = {"--arch": "arch", "--labels": "labels", "--resize-size": "resize_size", "--crop-size": "crop_size",
                   "--interpolation": "interpolation", "--mean": "mean", "--std": "std"}


def check_brought(args: argparse.Namespace) -> None:
    """ValueError saying what a model trained elsewhere needs and was not given (its target among them: --out or
    --repository, there being no run folder to take one from)."""
    flag = "--state-dict" if args.state_dict else "--torchscript"
    missing = [need for need, given in (("--labels FILE", args.labels), ("--name NAME", args.name),
                                        ("--out DIR or --repository DIR", args.out or args.repository),
                                        ("--arch ARCH", args.arch or args.torchscript)) if not given]
    if missing:
        raise ValueError(f"{flag} needs {', '.join(missing)} too")
    if args.torchscript and args.arch:
        raise ValueError("--arch names a --state-dict's architecture; a TorchScript file holds its own code")


def main(argv: Sequence[str] | None = None, started: float | None = None) -> int:
    """Entry point for ``python -m models.export``; returns the exit code. ``started``: when the command began
    (a ``time.perf_counter()`` reading), timed as its first step."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = get_args_parser().parse_args(argv)
    laps = Laps(since=started)
    if started is not None:
        laps.done("start")  # the interpreter and the imports
    try:
        # a checkpoint's export goes by default into its run's export/ (what the run's summary names): weights/ is
        # the bundled default model's folder (make serve serves it), replaced only when named
        out = None if args.repository else (args.out or (run_export(args.checkpoint) if args.checkpoint
                                                         else Path("weights")))
        brought = args.state_dict or args.torchscript
        if brought:  # no run folder to take a target from
            check_brought(args)
            out = args.out
        elif given := [flag for flag, value in BROUGHT_OPTIONS.items() if getattr(args, value) is not None]:
            raise ValueError(f"{', '.join(given)} describe a model trained elsewhere (--state-dict, --torchscript); "
                             f"{'a checkpoint' if args.checkpoint else 'the bundled model'} carries its own")
        targets = package_targets(args.packages, args.package_dtype)
        if brought:
            export_brought(brought, out, arch=args.arch if args.state_dict else None, labels=read_labels(args.labels),
                           preset=brought_preset(args.resize_size, args.crop_size, args.interpolation, args.mean,
                                                 args.std),
                           name=args.name, version=args.version, force=args.force, repository=args.repository,
                           packages=[] if args.torchscript and args.packages == "auto" else targets, laps=laps)
        elif args.checkpoint:
            export_checkpoint(args.checkpoint, out, name=args.name, version=args.version, force=args.force,
                              repository=args.repository, packages=targets, laps=laps)
        else:
            export_default(out, force=args.force, repository=args.repository, packages=targets, version=args.version,
                           laps=laps, name=args.name)
    # A model the server would refuse, a target that cannot be written, a compile that failed: one line each.
    except pydantic.ValidationError as exc:  # the preparation or the labels given
        log.error("error: %s", invalid_because(exc).removeprefix("the manifest: "))
        return 2
    except (OSError, ValueError, RuntimeError, ModelLoadError) as exc:
        log.error("error: %s", one_line(str(exc)))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(started=STARTED))
