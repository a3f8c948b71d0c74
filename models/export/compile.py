"""AOTInductor packages: a model compiled ahead of time, at export, for one device type and dtype.

``torch.export.export`` traces the eval-mode model with a dynamic batch dimension (1 to ``max_batch_size``) and
``torch._inductor.aoti_compile_and_package`` turns the graph into native code in one ``.pt2`` file; the server loads
it with ``aoti_load_package`` and no compiler. Compiling needs a C++ compiler (g++) and, for CUDA, the GPU it runs on.
The package is checked against the eager model before it is recorded: probabilities, and embeddings when the model
answers them, within ``TOLERANCE``.
"""
from __future__ import annotations

import copy
import logging
import shutil
import time
from pathlib import Path

import torch
import torch.nn as nn

from models.architectures import split_outputs
from models.export.manifest import CompiledPackage, sha256_of
from models.presets import EvalPreset

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 2e-2}  # largest probability (or embedding) difference


def package_name(device: str, dtype: str) -> str:
    """The package's file name in the export folder."""
    return f"model.{device}-{dtype}.pt2"


def cannot_compile(device: str) -> str | None:
    """Why no package for ``device`` ("cpu", "cuda") can be compiled on this machine (no GPU for CUDA, no C++
    compiler for either), None when one can: asked before an export writes anything."""
    if device == "cuda" and not torch.cuda.is_available():
        return "a CUDA package is compiled on a machine with a GPU (none here)"
    if not (shutil.which("g++") or shutil.which("c++")):
        return f"a {device} package is compiled with a C++ compiler (g++), and none is installed here"
    return None


def compile_package(model: nn.Module, preset: EvalPreset, out_dir: Path, device: str, dtype: str,
                    max_batch_size: int) -> CompiledPackage:
    """Compile ``model`` for ``device`` and ``dtype`` into ``out_dir``; RuntimeError if it does not match eager."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("a CUDA package is compiled on a machine with a GPU (none here)")
    started = time.perf_counter()
    module = copy.deepcopy(model).eval().to(device=device, dtype=DTYPES[dtype])
    example = torch.randn(2, *preset.input_shape, device=device, dtype=DTYPES[dtype])
    batch = torch.export.Dim("batch", min=1, max=max_batch_size)
    with torch.no_grad():
        program = torch.export.export(module, (example,), dynamic_shapes=({0: batch},))
        path = out_dir / package_name(device, dtype)
        torch._inductor.aoti_compile_and_package(program, package_path=str(path))
    compile_s = time.perf_counter() - started
    _check_matches(module, path, example, dtype)
    log.info("compiled %s in %.0fs", path.name, compile_s)
    return CompiledPackage(path=path.name, sha256=sha256_of(path), device=device, dtype=dtype,  # type: ignore[arg-type]
                           torch_version=torch.__version__, max_batch_size=max_batch_size,
                           compile_s=round(compile_s, 1))


def _check_matches(module: nn.Module, path: Path, example: torch.Tensor, dtype: str) -> None:
    runner = torch._inductor.aoti_load_package(str(path))
    with torch.inference_mode():
        for rows in (1, example.shape[0]):
            expected, expected_embedding = split_outputs(module(example[:rows]))
            got, got_embedding = split_outputs(runner(example[:rows]))
            difference = float((expected.float().softmax(dim=1) - got.float().softmax(dim=1)).abs().max())
            if expected_embedding is not None and got_embedding is not None:
                difference = max(difference, float((expected_embedding.float() - got_embedding.float()).abs().max()))
            if difference > TOLERANCE[dtype]:
                path.unlink(missing_ok=True)
                raise RuntimeError(f"the compiled package differs from the eager model by {difference:.3g} "
                                   f"(allowed {TOLERANCE[dtype]:g}) at batch {rows}")
