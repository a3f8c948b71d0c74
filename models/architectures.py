"""The only place architectures are named: ``build_model(arch, num_classes)``; and what a classifier's embedding
is: the input of its head (its last Linear layer), L2-normalised, returned beside the logits by ``WithEmbedding``
from the same forward pass (every served format is exported from it)."""
from __future__ import annotations

import copy
import functools
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


def _timm(name: str) -> Callable[[int], nn.Module]:
    def build(num_classes: int) -> nn.Module:
        import timm  # imported when a model is built: the server imports this module for its embeddings alone

        return timm.create_model(name, pretrained=False, num_classes=num_classes)

    return build


def _torchvision(name: str) -> Callable[[int], nn.Module]:
    def build(num_classes: int) -> nn.Module:
        import torchvision.models as tvm

        return tvm.get_model(name, weights=None, num_classes=num_classes)

    return build


# timm's ``tf_`` variant pads like TensorFlow ("same"), which the released Lite0 weights were trained with;
# plain ``efficientnet_lite0`` pads symmetrically and gives different outputs for the same weights.
_LIBRARY_NAMES: dict[str, str] = {  # each short name, as its library names the model it builds
    "efficientnet_lite0": "timm:tf_efficientnet_lite0",
    "resnet18": "torchvision:resnet18",
    "resnet50": "torchvision:resnet50",
    "mobilenet_v3_small": "torchvision:mobilenet_v3_small",
}


def same_arch(first: str, second: str) -> bool:
    """Whether two arch names build the same model: a short name and its library's (``mobilenet_v3_small`` and
    ``torchvision:mobilenet_v3_small``), or the same name."""
    return _LIBRARY_NAMES.get(first, first) == _LIBRARY_NAMES.get(second, second)


ARCHS: tuple[str, ...] = tuple(sorted(_LIBRARY_NAMES))
# Any other model of the two libraries, for weights trained elsewhere (models.export --state-dict): by its own name
LIBRARIES: dict[str, Callable[[str], Callable[[int], nn.Module]]] = {"timm": _timm, "torchvision": _torchvision}


def build_model(arch: str, num_classes: int) -> nn.Module:
    """Build an untrained ``arch`` with a ``num_classes`` head: one of ARCHS, or ``timm:NAME`` /
    ``torchvision:NAME`` (any model of that library); raises ValueError for unknown names."""
    library, _, name = _LIBRARY_NAMES.get(arch, arch).partition(":")
    if not (name and library in LIBRARIES):
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}, or timm:NAME or torchvision:NAME "
                         f"for another model of those libraries (e.g. timm:mobilenetv3_small_100)")
    if num_classes <= 0:
        raise ValueError(f"num_classes must be positive, got {num_classes}")
    try:
        return LIBRARIES[library](name)(num_classes)
    except (RuntimeError, ValueError, KeyError) as exc:  # timm: RuntimeError "Unknown model"; torchvision: ValueError
        raise ValueError(f"unknown arch {arch!r}: {library} has no model {name!r} ({exc})") from None


@functools.lru_cache(maxsize=16)
def meta_state_dict(arch: str, num_classes: int) -> dict[str, torch.Tensor]:
    """``arch``'s state dict for ``num_classes`` built on the meta device: its names and shapes alone (nothing
    allocated, nothing initialised). Kept: read it, never change it."""
    with torch.device("meta"):
        return build_model(arch, num_classes).state_dict()


@functools.lru_cache(maxsize=16)
def class_sized(arch: str) -> frozenset[str]:
    """The state-dict names of ``arch`` whose shapes follow its class count: its head (the last Linear layer; a
    SqueezeNet's last convolution), and any other layer sized by it (GoogLeNet's and Inception's auxiliary heads, a
    distilled ViT's second head). What a run started from other weights makes new, and what trains at the head's
    rate. Found by its state dict for two class counts (``meta_state_dict``)."""
    two, three = meta_state_dict(arch, 2), meta_state_dict(arch, 3)
    return frozenset(key for key, value in two.items() if key not in three or three[key].shape != value.shape)


def head_name(model: nn.Module) -> str:
    """The classification head's qualified name: the last Linear layer in module order, in every arch listed here
    (``classifier`` in EfficientNet, ``fc`` in ResNet, ``classifier.3`` in MobileNetV3)."""
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if not names:
        raise ValueError(f"{type(model).__name__} has no Linear head")
    return names[-1]


def head_of(model: nn.Module) -> nn.Module:
    """The classification head: the last Linear layer in module order, in every arch listed here."""
    return model.get_submodule(head_name(model))


class WithEmbedding(nn.Module):
    """``model`` answering ``(logits, embedding)`` from one forward pass: the embedding is the input of its head (the
    pooled features before the classifier: 1,280 values for EfficientNet-Lite0), L2-normalised, so the dot product
    of two is their cosine similarity. ``body`` is a copy of ``model`` with the head replaced by Identity, so the
    logits are the head of the body's output, as the whole model's are."""

    def __init__(self, model: nn.Module, layer: str) -> None:
        super().__init__()
        body = copy.deepcopy(model)
        parent, _, child = layer.rpartition(".")
        self.head = body.get_submodule(layer)
        setattr(body.get_submodule(parent) if parent else body, child, nn.Identity())
        self.body = body

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.body(x).flatten(1)
        return self.head(features), F.normalize(features, dim=1)


def with_embedding(model: nn.Module, example: torch.Tensor) -> WithEmbedding:
    """``model`` (put in eval mode) with its embedding beside its logits, taken at its head's input; ValueError when
    the logits differ from ``model``'s own on ``example`` (a head that is not the forward pass's last step)."""
    wrapped = WithEmbedding(model.eval(), head_name(model)).eval()
    with torch.inference_mode():
        expected = model(example)
        try:
            logits, _ = wrapped(example)
        except Exception:  # noqa: BLE001 - the head's input taken out breaks what follows it (timm's LeViT)
            logits = None
    if logits is None or expected.shape != logits.shape or not torch.allclose(expected, logits, atol=1e-5,
                                                                              rtol=1e-4):
        raise ValueError(f"{type(model).__name__}'s head {head_name(model)} is not the last step of its forward "
                         f"pass: its input is no embedding of the answer")
    return wrapped


def split_outputs(outputs: torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A served module's answer as ``(logits, embedding or None)``: an export with an embedding answers both (a
    tuple, or a list from ONNX Runtime and AOTInductor), one written before embeddings only the logits."""
    if isinstance(outputs, (tuple, list)):
        return outputs[0], (outputs[1] if len(outputs) > 1 else None)
    return outputs, None
