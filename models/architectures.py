"""The only place architectures are named: ``build_model(arch, num_classes)``."""
from __future__ import annotations

from typing import Callable

import timm
import torch.nn as nn
import torchvision.models as tvm


def _timm(name: str) -> Callable[[int], nn.Module]:
    return lambda num_classes: timm.create_model(name, pretrained=False, num_classes=num_classes)


def _torchvision(name: str) -> Callable[[int], nn.Module]:
    return lambda num_classes: tvm.get_model(name, weights=None, num_classes=num_classes)


# timm's ``tf_`` variant pads like TensorFlow ("same"), which the released Lite0 weights were trained with;
# plain ``efficientnet_lite0`` pads symmetrically and gives different outputs for the same weights.
_BUILDERS: dict[str, Callable[[int], nn.Module]] = {
    "efficientnet_lite0": _timm("tf_efficientnet_lite0"),
    "resnet18": _torchvision("resnet18"),
    "resnet50": _torchvision("resnet50"),
    "mobilenet_v3_small": _torchvision("mobilenet_v3_small"),
}

ARCHS: tuple[str, ...] = tuple(sorted(_BUILDERS))


def build_model(arch: str, num_classes: int) -> nn.Module:
    """Build an untrained ``arch`` with a ``num_classes`` head; raises ValueError for unknown names."""
    if arch not in _BUILDERS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if num_classes <= 0:
        raise ValueError(f"num_classes must be positive, got {num_classes}")
    return _BUILDERS[arch](num_classes)


def head_of(model: nn.Module) -> nn.Module:
    """The classification head: the last Linear layer in module order, in every arch listed here."""
    linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
    if not linears:
        raise ValueError(f"{type(model).__name__} has no Linear head")
    return linears[-1]
