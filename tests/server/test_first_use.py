"""What a new user trips on first (#17): serving an own model, exporting over one, misspelt settings."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from app.config import unknown_variables
from harness.servers import ROOT
from models.export.__main__ import main as export_main
from tests.support.fakes import export_tiny, served_over_http

NO_PACKAGES = ["--packages", "none"]  # compiling an AOTInductor package takes a minute: tests/app/test_packages.py


def _make_serve(target: str = "serve", **env: str) -> str:
    """The commands `make serve` (or ``target``) would run (make -n), with the installation taken as done."""
    result = subprocess.run(["make", "-n", "-o", ".venv/.installed", target], cwd=ROOT, capture_output=True,
                            text=True, env={**os.environ, **env}, check=True)
    return result.stdout


def test_the_weights_dir_variable_wins_over_the_makefile_default() -> None:
    # Before: the Makefile passed its own WEIGHTS_DIR, so `VISIONSERVE_WEIGHTS_DIR=runs/x make serve` served ImageNet.
    commands = _make_serve(VISIONSERVE_WEIGHTS_DIR="runs/x/export")
    assert 'VISIONSERVE_WEIGHTS_DIR="runs/x/export" ' in commands
    assert "models.export" not in commands  # your directory is never filled with the packaged model
    assert 'VISIONSERVE_WEIGHTS_DIR="elsewhere" ' in _make_serve(WEIGHTS_DIR="elsewhere")


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_export_refuses_to_replace_a_different_model_without_force(tmp_path: Path) -> None:
    # Before: `models.export ... --out weights/` silently overwrote the default model.
    export_tiny(tmp_path, version="1")
    export_tiny(tmp_path, version="1")  # the same model again: fine
    with pytest.raises(FileExistsError, match="already holds mine 1.*--force"):
        export_tiny(tmp_path, version="2")
    assert '"version": "1"' in (tmp_path / "manifest.json").read_text()
    export_tiny(tmp_path, version="2", force=True)
    assert '"version": "2"' in (tmp_path / "manifest.json").read_text()
    assert export_main(["--default", "--out", str(tmp_path), *NO_PACKAGES]) == 2  # the CLI says so and exits 2


def test_make_samples_writes_the_photos_the_docs_send_and_keeps_files_already_there(tmp_path: Path) -> None:
    # Before: the README's first commands (`curl -F image=@cat.jpg ...`) failed in a fresh clone: no cat.jpg, and no
    # word of where to find one
    import sys

    from PIL import Image

    assert "make samples" in (ROOT / "README.md").read_text()
    assert ".venv/bin/python -m demo_data samples --out .\n" in _make_serve(target="samples")
    (tmp_path / "cup.jpg").write_bytes(b"mine")
    done = subprocess.run([sys.executable, "-m", "demo_data", "samples", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    with Image.open(tmp_path / "cat.jpg") as cat:
        assert cat.format == "JPEG" and cat.size == (451, 300)  # scikit-image's chelsea
    assert (tmp_path / "cup.jpg").read_bytes() == b"mine" and "kept" in done.stderr  # never overwritten


def test_a_misspelt_setting_is_named_with_the_closest_one() -> None:
    warnings = unknown_variables({"VISIONSERVE_WORKER": "2", "VISIONSERVE_WORKERS": "2", "VISIONSERVE_URL": "x",
                                  "VISIONSERVE_ZZZ": "1", "PATH": "/bin"})
    assert warnings == ["VISIONSERVE_WORKER is not a setting and is ignored (did you mean VISIONSERVE_WORKERS?)",
                        "VISIONSERVE_ZZZ is not a setting and is ignored (docs/configuration.md lists the settings)"]


def test_a_setting_whose_prefix_is_misspelt_is_named_and_other_variables_are_left_alone() -> None:
    # Before: VISONSERVE_WORKERS=1 was silent, and the server started with 2 workers (a misconfiguring operator's trial)
    warnings = unknown_variables({"VISONSERVE_WORKERS": "1", "VISIONSRVE_DEVICE": "cpu", "VISION_WORKERS": "2",
                                  "SERVE_WORKERS": "1", "VISONSERVE_NOT_A_SETTING": "1", "HOME": "/root"})
    assert warnings == ["VISIONSRVE_DEVICE is not a setting and is ignored (did you mean VISIONSERVE_DEVICE?)",
                        "VISONSERVE_WORKERS is not a setting and is ignored (did you mean VISIONSERVE_WORKERS?)"]


@pytest.fixture(scope="module")
def photo_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new user's folder: 4 classes, 30 training images each (patches of real photos), 15 val each."""
    from demo_data.small_sets import write_textures

    out = tmp_path_factory.mktemp("photos")
    write_textures(out, per_class=30, classes=("brick", "grass", "gravel", "moon"))
    return out


def test_a_new_user_trains_exports_serves_and_calls_their_model(photo_folder: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    # The README's recipe, end to end: the pretrained fine-tune on 4 x 30 images, the export into the run, the
    # server on that export, then the client and the CLI, without a single error.
    from app import EXTENSION_KEY
    from app.factory import create_app
    from app.config import Settings
    from visionserve_client import Client
    from visionserve_client.__main__ import main as cli
    from models import train

    run = tmp_path / "run"
    assert train.main(["--data", str(photo_folder), "--arch", "efficientnet_lite0", "--pretrained",
                       "--freeze-backbone", "--epochs", "2", "--workers", "0", "--device", "cpu",
                       "--output-dir", str(run)]) == 0
    assert export_main(["--checkpoint", str(run / "best.pt"), "--out", str(run / "export"), *NO_PACKAGES]) == 0
    app = create_app(Settings(weights_dir=run / "export", device="cpu", log_level="warning"))
    try:
        with served_over_http(app) as url:
            grass = sorted((photo_folder / "val" / "grass").iterdir())[:3]
            with Client(url) as client:
                assert client.model().name == "run"
                predictions = client.predict(grass)  # top_k left to the server: 4 classes, not 5
            assert [len(p.top_k) for p in predictions] == [4, 4, 4]
            assert [p.label for p in predictions].count("grass") >= 2
            assert cli(["predict", *map(str, grass), "--url", url]) == 0
            assert "grass" in capsys.readouterr().out
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=10)
