"""Write a model into a weights directory: TorchScript file, state dict and ``manifest.json``.

    python -m models.export --default --out weights                          # the bundled Lite0 (ImageNet)
    python -m models.export --checkpoint runs/NAME/best.pt --out weights     # a model from models.train
    python -m models.export --checkpoint runs/NAME/best.pt --repository models   # models/NAME/<next number>/
"""
from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path
from typing import Sequence

import torch

from models.export.compile import DTYPES
from models.export.write import export_checkpoint, export_default

log = logging.getLogger("models.export")


def get_args_parser() -> argparse.ArgumentParser:
    """Command-line options of the exporter."""
    parser = argparse.ArgumentParser(prog="python -m models.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--default", action="store_true", help="export the bundled EfficientNet-Lite0 (ImageNet)")
    source.add_argument("--checkpoint", type=Path, help="a checkpoint written by models.train (e.g. best.pt)")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--out", type=Path, default=None, help="weights directory to write (default: weights)")
    target.add_argument("--repository", type=Path, default=None,
                        help="a model repository: writes <repository>/<name>/<version>, the next version number "
                             "unless --version says")
    parser.add_argument("--name", default=None, help="model name (default: the run's folder name)")
    parser.add_argument("--version", default=None,
                        help="model version (default: the checkpoint's date and a digest of its weights)")
    parser.add_argument("--force", action="store_true", help="replace a different model already in --out")
    parser.add_argument("--packages", default="auto",
                        help="AOTInductor packages to compile (needs g++): cpu, cuda, both (cpu,cuda), none; auto: "
                             "cpu, and cuda when a GPU is present")
    parser.add_argument("--package-dtype", default="float32", choices=sorted(DTYPES),
                        help="the dtype of the CUDA package: the server's VISIONSERVE_DTYPE (CPU packages: float32)")
    return parser


def package_targets(packages: str, cuda_dtype: str) -> list[tuple[str, str]]:
    """``--packages`` as (device, dtype) pairs."""
    if packages == "none":
        return []
    if packages == "auto" and not (shutil.which("g++") or shutil.which("c++")):
        log.warning("no C++ compiler (g++): no AOTInductor package; the server will serve TorchScript")
        return []
    devices = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])] if packages == "auto" else packages.split(",")
    unknown = set(devices) - {"cpu", "cuda"}
    if unknown:
        raise ValueError(f"--packages takes cpu, cuda, cpu,cuda, none or auto, got {packages!r}")
    return [(device, "float32" if device == "cpu" else cuda_dtype) for device in devices]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for ``python -m models.export``; returns the exit code."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = get_args_parser().parse_args(argv)
    out = None if args.repository else (args.out or Path("weights"))
    try:
        targets = package_targets(args.packages, args.package_dtype)
        manifest = (export_checkpoint(args.checkpoint, out, name=args.name, version=args.version,
                                      force=args.force, repository=args.repository, packages=targets)
                    if args.checkpoint else export_default(out, force=args.force, repository=args.repository,
                                                           packages=targets))
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        log.error("error: %s", exc)
        return 2
    where = args.repository / manifest.name / manifest.version if args.repository else out
    log.info("wrote %s %s (%d classes) to %s", manifest.name, manifest.version, manifest.num_classes, where)
    return 0


if __name__ == "__main__":
    sys.exit(main())
