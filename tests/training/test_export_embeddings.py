"""Every export records its embedding and every format it writes answers it beside the logits, from one forward
pass, as the state dict's model does (#52)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.architectures import ARCHS, build_model, head_name, split_outputs, with_embedding
from models.export.load import load_model
from models.export.manifest import read_manifest
from tests.support.fakes import export_tiny

DIMS = {"efficientnet_lite0": 1280, "mobilenet_v3_small": 1024, "resnet18": 512, "resnet50": 2048}


@pytest.mark.parametrize("arch", [pytest.param(arch, marks=pytest.mark.slow) if arch == "resnet50" else arch
                                  for arch in ARCHS])  # resnet50's: seconds, the full suite's
def test_every_architecture_s_embedding_is_its_head_s_input_and_leaves_its_logits_as_they_were(arch: str) -> None:
    torch.manual_seed(0)
    model = build_model(arch, 5).eval()
    images = torch.rand(2, 3, 64, 64)
    served = with_embedding(model, images)
    logits, embedding = served(images)
    with torch.inference_mode():
        assert torch.allclose(logits, model(images), atol=1e-5)
    assert embedding.shape == (2, DIMS[arch]) and torch.allclose(embedding.norm(dim=1), torch.ones(2), atol=1e-5)
    head = model.get_submodule(head_name(model))
    captured: list[torch.Tensor] = []
    head.register_forward_hook(lambda _, inputs, __: captured.append(inputs[0]))
    with torch.inference_mode():
        model(images)
    assert torch.allclose(embedding, torch.nn.functional.normalize(captured[0], dim=1), atol=1e-5)


def test_a_head_that_is_not_the_last_step_is_refused() -> None:
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3), torch.nn.Softmax(dim=1))
    with pytest.raises(ValueError, match="not the last step"):
        with_embedding(model, torch.rand(2, 3, 2, 2))


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_tiny(tmp_path_factory.mktemp("embedding"), packages=(("onnx", "float32"),), head_scale=1e10)


@pytest.mark.slow  # a real export with ONNX (about 5 s)
def test_every_format_answers_the_state_dict_s_embedding_from_one_forward_pass(export: Path) -> None:
    manifest = read_manifest(export)
    assert manifest.embedding is not None and (manifest.embedding.layer, manifest.embedding.dim) == ("classifier.3",
                                                                                                      1024)
    torch.manual_seed(1)
    images = torch.rand(3, 3, 32, 32)
    answers = {}
    for fmt in ("state_dict", "torchscript", "onnx"):
        loaded = load_model(export, weights_format=fmt, device="cpu")
        with torch.inference_mode():
            answers[fmt] = split_outputs(loaded.module(images))
    reference_logits, reference = answers["state_dict"]
    for fmt, (logits, embedding) in answers.items():
        assert embedding is not None and embedding.shape == (3, 1024), fmt
        assert float((embedding - reference).abs().max()) < 1e-5, fmt
        assert torch.equal(logits.argmax(dim=1), reference_logits.argmax(dim=1)), fmt


@pytest.mark.slow  # a real export with ONNX (about 5 s)
def test_a_manifest_written_before_embeddings_still_loads_and_answers_logits_alone(export: Path,
                                                                                    tmp_path: Path) -> None:
    import json
    import shutil

    old = tmp_path / "old"
    shutil.copytree(export, old)
    written = json.loads((old / "manifest.json").read_text())
    del written["embedding"]
    (old / "manifest.json").write_text(json.dumps(written))
    loaded = load_model(old, weights_format="state_dict", device="cpu")
    with torch.inference_mode():
        logits, embedding = split_outputs(loaded.module(torch.rand(1, 3, 32, 32)))
    assert embedding is None and logits.shape == (1, 3)
    # TorchScript written with an embedding does not match a manifest without one: refused, not half-served
    from models.export.checks import ModelLoadError

    with pytest.raises(ModelLoadError, match="embedding"):
        load_model(old, weights_format="torchscript", device="cpu")
