"""How a model's failure is told in a 500's message (app/errors.py InferenceFailed.of), in both engine layouts."""
from __future__ import annotations

import warnings

import pytest
import torch

from app.errors import FAILURE_WORDS_CHARS, InferenceFailed


class Refusing(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x.mean() > 0.5):
            raise RuntimeError("bright image not supported")
        return x


def test_a_torchscript_model_s_failure_is_told_by_its_own_words_not_its_kind() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.script's deprecation
        scripted = torch.jit.script(Refusing())
    with pytest.raises(Exception) as raised:
        scripted(torch.ones(2))
    assert type(raised.value).__name__ == "Error"  # all a message of its kind alone said
    failed = InferenceFailed.of(raised.value, "the model failed")
    assert failed.message == "the model failed: RuntimeError: bright image not supported"
    assert (failed.status, failed.code) == (500, "inference_failed")


@pytest.mark.parametrize("exc, said", [
    (RuntimeError("fake forward failure"), "x: RuntimeError: fake forward failure"),
    (KeyError("logits"), "x: KeyError: 'logits'"),
    (ValueError(), "x: ValueError"),
    (RuntimeError("a" * 1000), "x: RuntimeError: " + "a" * (FAILURE_WORDS_CHARS - 17) + "..."),
])
def test_a_python_model_s_failure_is_told_by_its_kind_and_words_at_most_so_long(exc: BaseException,
                                                                                  said: str) -> None:
    assert InferenceFailed.of(exc, "x").message == said
