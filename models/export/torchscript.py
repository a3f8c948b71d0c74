"""TorchScript: scripting a model at export (checked against eager), and quieting torch.jit for the export and the
server (which loads the format)."""
from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Iterator

import torch
import torch.nn as nn

log = logging.getLogger("models.export")


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


def check_same_outputs(model: nn.Module, scripted: torch.jit.ScriptModule, example: torch.Tensor) -> None:
    """RuntimeError unless the scripted model gives the eager model's outputs on ``example``."""
    with torch.inference_mode():
        expected, got = model(example), scripted(example)
    pairs = zip(expected, got) if isinstance(expected, tuple) else [(expected, got)]  # logits, and the embedding
    for wanted, answered in pairs:
        if not torch.allclose(wanted, answered, atol=1e-5, rtol=1e-4):
            raise RuntimeError(f"TorchScript output differs from eager by {(wanted - answered).abs().max():.3g}")
