"""Two real versions of one model for rollouts (tests/server/test_rollouts.py, bench/serving/shadow_cost.py): the
packaged EfficientNet-Lite0 as version 1 and a copy whose head is perturbed as version 2, so the two disagree on
some real photos (about a third of the benchmark's)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Sequence

import torch

MODEL = "efficientnet_lite0"
HEAD_NOISE = 0.5  # the perturbation, in standard deviations of the head's weights


def two_lite0_versions(root: Path, first: Path | None = None, rollout: dict[str, Any] | None = None,
                       packages: Sequence[tuple[str, str]] = ()) -> Path:
    """``root/efficientnet_lite0/{1,2}``: 1 copied from the export ``first`` (else exported), 2 the perturbed copy
    (both with ``packages``, e.g. (("onnx", "float32"),)); ``rollout`` written to its policy.json. Returns root."""
    from models.architectures import head_of
    from models.export.write import export_default, export_model
    from models.presets import lite0_preset
    from models.pretrained import imagenet_labels, load_lite0_imagenet

    model_dir = root / MODEL
    if first is not None:
        shutil.copytree(first, model_dir / "1", dirs_exist_ok=True)
    else:
        export_default(model_dir / "1", force=True, packages=packages)
    model = load_lite0_imagenet()
    head = head_of(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        head.weight.add_(torch.randn(head.weight.shape, generator=generator) * head.weight.std() * HEAD_NOISE)
    export_model(model, out_dir=model_dir / "2", name=MODEL, version="2", arch=MODEL, labels=imagenet_labels(),
                 preset=lite0_preset(), source="the packaged Lite0 with its head perturbed (a rollout candidate)",
                 force=True, packages=packages)
    set_rollout(root, rollout)
    return root


def set_rollout(root: Path, rollout: dict[str, Any] | None) -> None:
    """The model's policy.json: ``{"rollout": rollout}``, or none."""
    policy = root / MODEL / "policy.json"
    if rollout is None:
        policy.unlink(missing_ok=True)
    else:
        policy.write_text(json.dumps({"rollout": rollout}), encoding="utf-8")
