"""What a new user trips on first (#17): serving an own model, exporting over one, misspelt settings."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from app.config import unknown_variables
from bench.servers import ROOT
from models.export import export_model
from models.export import main as export_main
from models.presets import EvalPreset
from models.registry import build_model


def _make_serve(**env: str) -> str:
    """The commands `make serve` would run (make -n), with the installation taken as done."""
    result = subprocess.run(["make", "-n", "-o", ".venv/.installed", "serve"], cwd=ROOT, capture_output=True,
                            text=True, env={**os.environ, **env}, check=True)
    return result.stdout


def test_the_weights_dir_variable_wins_over_the_makefile_default() -> None:
    # Before: the Makefile passed its own WEIGHTS_DIR, so `VISIONSERVE_WEIGHTS_DIR=runs/x make serve` served ImageNet.
    commands = _make_serve(VISIONSERVE_WEIGHTS_DIR="runs/x/export")
    assert "VISIONSERVE_WEIGHTS_DIR=runs/x/export " in commands
    assert "models.export" not in commands  # your directory is never filled with the packaged model
    assert "VISIONSERVE_WEIGHTS_DIR=elsewhere " in _make_serve(WEIGHTS_DIR="elsewhere")


def _export(out: Path, version: str, force: bool = False) -> None:
    torch.manual_seed(0)
    export_model(build_model("mobilenet_v3_small", 3), out_dir=out, name="mine", version=version,
                 arch="mobilenet_v3_small", labels=["a", "b", "c"], preset=EvalPreset(resize_size=40, crop_size=32),
                 force=force)


def test_export_refuses_to_replace_a_different_model_without_force(tmp_path: Path) -> None:
    # Before: `models.export ... --out weights/` silently overwrote the default model.
    _export(tmp_path, "1")
    _export(tmp_path, "1")  # the same model again: fine
    with pytest.raises(FileExistsError, match="already holds mine 1.*--force"):
        _export(tmp_path, "2")
    assert '"version": "1"' in (tmp_path / "manifest.json").read_text()
    _export(tmp_path, "2", force=True)
    assert '"version": "2"' in (tmp_path / "manifest.json").read_text()
    assert export_main(["--default", "--out", str(tmp_path)]) == 2  # the CLI says so and exits 2


def test_a_misspelt_setting_is_named_with_the_closest_one() -> None:
    warnings = unknown_variables({"VISIONSERVE_WORKER": "2", "VISIONSERVE_WORKERS": "2", "VISIONSERVE_URL": "x",
                                  "VISIONSERVE_ZZZ": "1", "PATH": "/bin"})
    assert warnings == ["VISIONSERVE_WORKER is not a setting and is ignored (did you mean VISIONSERVE_WORKERS?)",
                        "VISIONSERVE_ZZZ is not a setting and is ignored (docs/configuration.md lists the settings)"]
