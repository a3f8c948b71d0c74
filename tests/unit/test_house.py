"""The house rules, checked: import direction between the layers, short functions, generated docs up to date."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from app import configdoc

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "app"
PROTOCOLS = ("app.v1", "app.v2")
MAX_FUNCTION_LINES = 50


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in the file (inside functions too: those run as well)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _under(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _modules(package: str) -> dict[str, set[str]]:
    base = ROOT.joinpath(*package.split("."))
    files = [base.with_suffix(".py")] if base.with_suffix(".py").is_file() else sorted(base.rglob("*.py"))
    return {_module_name(f): _imports(f) for f in files}


@pytest.mark.parametrize("package, forbidden", [
    ("app.engine", ("flask", "werkzeug", "flask_swagger_ui", "app.web", *PROTOCOLS)),
    ("app.config", ("app", "models", "torch", "flask")),
    ("app.errors", ("app", "models", "flask", "werkzeug")),
    ("app.metrics", ("app.engine", "app.web", *PROTOCOLS, "flask")),
    ("app.procstat", ("app", "flask", "torch")),
    ("app.web", PROTOCOLS),
    ("app.v1", ("app.v2",)),
    ("app.v2", ("app.v1",)),
    ("models", ("app",)),
])
def test_import_direction(package: str, forbidden: tuple[str, ...]) -> None:
    broken = {module: sorted(n for n in names if _under(n, forbidden) and not _under(n, (module,)))
              for module, names in _modules(package).items()}
    assert not {m: n for m, n in broken.items() if n}, f"{package} may not import {forbidden}"


def test_protocols_reach_the_engine_only_through_the_stage_runner() -> None:
    # Arrivals, the batcher and decoding are the runner's business: a protocol that chains them itself can lose
    # the inline path or the arrival count silently.
    internals = ("app.engine.arrivals", "app.engine.batcher", "app.engine.decode", "app.engine.batch_types")
    for package in PROTOCOLS:
        for module, names in _modules(package).items():
            assert not [n for n in names if _under(n, internals)], module


def test_importing_the_engine_loads_no_flask() -> None:
    code = ("import sys, app.engine.service, app.engine.weights, app.engine.malloc; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('flask', 'werkzeug') "
            "or m.startswith(('app.web', 'app.v1', 'app.v2'))]; print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_gunicorn_master_imports_neither_torch_nor_flask() -> None:
    code = ("import runpy, sys; runpy.run_path('gunicorn.conf.py'); "
            "bad = [m for m in ('torch', 'flask') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("folder", ["app", "client"])
def test_no_function_is_longer_than_50_lines(folder: str) -> None:
    long = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long


def test_configuration_doc_is_generated_from_the_settings() -> None:
    assert configdoc.DOC.read_text(encoding="utf-8") == configdoc.render(), \
        "docs/configuration.md is out of date: run `python -m app.configdoc`"
    assert configdoc.main(["--check"]) == 0


def test_every_setting_has_a_description() -> None:
    from app.config import Settings

    assert not [name for name, field in Settings.model_fields.items() if not field.description]


def test_readme_is_a_map_of_at_most_150_lines_linking_every_docs_page() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 150
    assert "make serve" in readme.split("\n## ")[0] and "make test" in readme.split("\n## ")[0]
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert {"api.md", "configuration.md", "architecture.md", "deployment.md", "training.md", "performance.md",
            "testing.md"} <= set(pages)
    assert not [p for p in pages if f"docs/{p}" not in readme]
