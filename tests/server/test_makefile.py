"""The Makefile's set-up, data and export rules, and bin/serve, run for real where that is cheap: make with this
checkout's Makefile in a temporary folder (-f), or make -n here."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.servers import ROOT

MAKEFILE = ROOT / "Makefile"
FAKE_DEMO_DATA = """#!/bin/sh
# python -m demo_data NAME --out DIR as make runs it: refuses a folder that is not empty (as the real one does);
# with FAKE_STOP set, stops (fails) after its first file, as an interrupted run would.
[ "$1 $2" = "-m demo_data" ] || exit 3
out=$5
if [ -d "$out" ] && [ -n "$(ls -A "$out")" ]; then echo "error: $out is not empty" >&2; exit 2; fi
mkdir -p "$out/train" "$out/val"
echo first > "$out/train/first.png"
[ -z "$FAKE_STOP" ] || exit 1
echo last > "$out/val/last.png"
"""


def _make(folder: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """This checkout's Makefile run in ``folder``."""
    return subprocess.run(["make", "--no-print-directory", "-f", str(MAKEFILE), *args], cwd=folder,
                          capture_output=True, text=True, env={**os.environ, **env}, timeout=120)


def _installed(folder: Path, python: str) -> Path:
    """``folder`` as make sees a finished install: requirements files, .venv/bin/python (``python``, a script) and
    the install stamp, newer than the requirements."""
    for name in ("requirements.txt", "requirements-dev.txt"):
        (folder / name).write_text("")
    bin_dir = folder / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(python)
    (bin_dir / "python").chmod(0o755)
    stamp = folder / ".venv" / ".installed"
    stamp.touch()
    os.utime(stamp, (time.time() + 10, time.time() + 10))
    return stamp


@pytest.mark.slow  # a second or more (a run of the CLI, make, or workers sharing a state): the full suite's
def test_a_half_made_venv_is_made_again(tmp_path: Path) -> None:
    # Before: `test -x .venv/bin/python || python3 -m venv .venv` took a .venv without pip (a first make stopped while
    # venv ran ensurepip) as made: every later make failed with "No module named pip".
    for name in ("requirements.txt", "requirements-dev.txt"):
        (tmp_path / name).write_text("")  # nothing to install: pip runs, offline
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", ".venv"], cwd=tmp_path, check=True)
    assert (tmp_path / ".venv" / "bin" / "python").exists()
    done = _make(tmp_path, f"PYTHON={sys.executable}", ".venv/.installed", PIP_NO_INDEX="1",
                 PIP_DISABLE_PIP_VERSION_CHECK="1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / ".venv" / ".installed").exists()
    subprocess.run([str(tmp_path / ".venv" / "bin" / "python"), "-m", "pip", "--version"], check=True,
                   capture_output=True)


def test_a_data_folder_is_written_whole_and_kept_over_a_reinstall(tmp_path: Path) -> None:
    # Before: data/digits depended on the install stamp's time (after a re-install it was out of date, and demo_data
    # refused the folder that was not empty: exit 2), and a stopped first run left a folder taken as done.
    stamp = _installed(tmp_path, FAKE_DEMO_DATA)
    digits = tmp_path / "data" / "digits"
    stopped = _make(tmp_path, "data/digits", FAKE_STOP="1")
    assert stopped.returncode != 0 and (digits / "train" / "first.png").exists()
    done = _make(tmp_path, "data/digits")  # the stopped run's folder is written again, whole
    assert done.returncode == 0, done.stdout + done.stderr
    assert (digits / "val" / "last.png").exists()
    os.utime(stamp, (time.time() + 20, time.time() + 20))  # a re-install (a requirements file changed)
    again = _make(tmp_path, "data/digits")
    assert again.returncode == 0 and "demo_data" not in again.stdout, again.stdout + again.stderr
    assert "demo_data" not in _make(tmp_path, "-n", "train-digits").stdout


def _remakes_weights(folder: Path, changed: str) -> bool:
    """Whether `make weights` exports the default model again once ``changed`` (a file here) changed, the default
    export being ``folder``'s (newer than every source)."""
    commands = subprocess.run(["make", "-n", "-o", ".venv/.installed", "-W", changed, f"DEFAULT_WEIGHTS={folder}",
                               "weights"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return "-m models.export --default" in commands


@pytest.mark.slow  # a second or more (a run of the CLI, make, or workers sharing a state): the full suite's
def test_the_default_export_is_remade_when_any_code_it_runs_changes(tmp_path: Path) -> None:
    # Before: a change of models/presets.py (the preprocessing the manifest records) left weights/ as it was.
    (tmp_path / "manifest.json").write_text("{}")
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, models.export.__main__, models.pretrained, models.presets\n"
         "print('\\n'.join(m.__file__ for n, m in list(sys.modules.items()) if n.split('.')[0] == 'models'))"],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    sources = {str(Path(path).relative_to(ROOT)) for path in loaded}
    # models/run/args.py: the command line's help format only (and its package), nothing an export writes
    sources -= {"models/run/__init__.py", "models/run/args.py"}
    assert {"models/presets.py", "models/pretrained.py", "models/export/write.py"} <= sources
    assert [path for path in sorted(sources) if not _remakes_weights(tmp_path, path)] == []
    assert not _remakes_weights(tmp_path, "models/train.py")  # training code: no export


def test_make_serve_passes_a_weights_folder_with_a_space(tmp_path: Path) -> None:
    # Before: VISIONSERVE_WEIGHTS_DIR=$(WEIGHTS_DIR) unquoted: env got ".../my" and tried to run "weights", and the
    # word "weights" in the path made make export the default model first.
    folder = tmp_path / "my weights"
    assert "models.export" not in subprocess.run(
        ["make", "-n", "-o", ".venv/.installed", "serve", f"VISIONSERVE_WEIGHTS_DIR={folder}"], cwd=ROOT,
        capture_output=True, text=True, check=True).stdout
    served = subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", "-o", ".venv/bin/visionserve",
                             "-o", "weights/manifest.json", "serve", f"VISIONSERVE_WEIGHTS_DIR={folder}",
                             "SERVE=printenv VISIONSERVE_WEIGHTS_DIR"], cwd=ROOT, capture_output=True, text=True)
    assert served.returncode == 0 and served.stdout.splitlines()[-1] == str(folder), served.stdout + served.stderr


@pytest.mark.slow  # a second or more (a run of the CLI, make, or workers sharing a state): the full suite's
@pytest.mark.parametrize("venv_on_path", [True, False], ids=["elsewhere", "elsewhere-venv-not-on-path"])
def test_bin_serve_runs_from_any_folder(tmp_path: Path, venv_on_path: bool) -> None:
    # Before: gunicorn.conf.py and app.wsgi were looked for in the caller's folder, and gunicorn on the PATH (a fresh
    # shell has no .venv/bin there).
    venv_bin = Path(sys.executable).parent
    if not venv_on_path and not (ROOT / ".venv" / "bin" / "gunicorn").exists():
        pytest.skip("no .venv in this checkout")
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                           if p and Path(p).resolve() != (ROOT / ".venv" / "bin").resolve()
                           and Path(p).resolve() != venv_bin.resolve())
    env = {**{k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"},
           "PATH": f"{venv_bin}{os.pathsep}{path}" if venv_on_path else path,
           "VISIONSERVE_WEIGHTS_DIR": str(tmp_path / "none")}
    shown = subprocess.run([str(ROOT / "bin" / "serve"), "--print-config"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stdout[-2000:] + shown.stderr[-2000:]
    settings = {key.strip(): value.strip() for key, value in (line.split(" = ", 1) for line in
                                                              shown.stdout.splitlines() if " = " in line)}
    assert settings["config"] == "gunicorn.conf.py" and settings["chdir"] == str(ROOT), shown.stdout
    assert settings["worker_class"] == "app.hosting.worker.BufferingWorker"  # gunicorn.conf.py's, not the default
