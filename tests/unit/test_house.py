"""The house rules, checked: import direction between the layers, no import cycle, short functions, generated docs
up to date."""
from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

from app import configdoc, metricsdoc

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "app"
PROTOCOLS = ("app.v1", "app.v2")
MAX_FUNCTION_LINES = 50
# every project .py file lives in one
PACKAGES = ("app", "bench", "demo_data", "harness", "models", "tests", "visionserve_client")


def _tree(path: Path) -> ast.Module:
    """A file parsed, its text once a test process: several checks here walk every file of the project."""
    return _parsed(path.read_text(encoding="utf-8"))


@functools.cache
def _parsed(source: str) -> ast.Module:
    return ast.parse(source)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in the file (inside functions too: those run as well)."""
    found: set[str] = set()
    for node in ast.walk(_tree(path)):
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
    # Hidden folders are not the project's code: bench/.venv-litserve and bench/.venv-formats hold whole venvs.
    return {_module_name(f): _imports(f) for f in files
            if not any(part.startswith(".") for part in f.relative_to(ROOT).parts)}


# What runs in an HTTP worker under ENGINE=process (and in the gunicorn master): it reaches the engine through
# app.engine.contract (torch-free data and the faces) and app.engine.lifecycle (what both services do alike) only,
# never a wing, the service or torch.
HTTP_SIDE = ("app.web", *PROTOCOLS, "app.link.client", "app.link.wire", "app.link.supervisor", "app.hosting")
ENGINE_FOR_THE_HTTP_SIDE = ("app.engine.contract", "app.engine.lifecycle")


@pytest.mark.parametrize("package, forbidden", [
    ("app.engine", ("flask", "werkzeug", "flask_swagger_ui", "app.web", *PROTOCOLS, "app.link", "app.factory",
                    "app.wsgi", "app.hosting.starting", "app.hosting.worker", "app.hosting.request_framing",
                    "app.hosting.client_socket", "app.hosting.drain", "app.hosting.procstat")),
    ("app.hosting", ("torch", "flask", "werkzeug", "app.engine", "app.link", "app.web", *PROTOCOLS, "app.factory")),
    ("app.link.supervisor", ("torch", "flask", "app.engine", "app.link.client", "app.link.server",
                             "app.link.loop")),
    ("app.link.client", ("flask", "werkzeug", "app.link.server", "app.link.loop", "app.web", *PROTOCOLS)),
    ("app.link.wire", ("flask", "werkzeug", "app.link.client", "app.link.server", "app.link.loop",
                       "app.hosting.worker", "app.hosting.request_framing", "app.hosting.client_socket",
                       "app.hosting.starting", "app.hosting.drain", "app.hosting.control", "app.hosting.host",
                       "app.hosting.procstat")),  # of the hosting, how the HTTP side waits only
    ("app.hosting.waiting", ("app", "gunicorn", "greenlet")),
    ("app.hosting.loop_requests", ("app", "gunicorn", "flask", "torch")),
    # how a request is read off the wire, and how its answer is written: neither knows the worker's loop
    ("app.hosting.request_framing", ("app.hosting", "greenlet", "flask", "torch")),
    ("app.hosting.client_socket", ("app.hosting.worker", "app.hosting.loop_requests", "greenlet", "flask", "torch")),
    ("app.config", ("app", "models", "torch", "flask")),
    ("app.errors", ("app", "models", "flask", "werkzeug")),
    ("app.metrics", ("app.engine", "app.web", *PROTOCOLS, "flask")),
    ("app.hosting.procstat", ("app", "flask", "torch")),
    ("app.web", PROTOCOLS),
    ("app.v1", ("app.v2",)),
    ("app.v2", ("app.v1",)),
    ("models", ("app",)),
    ("harness", ("tests", "bench")),
    ("bench", ("tests",)),
])
def test_import_direction(package: str, forbidden: tuple[str, ...]) -> None:
    broken = {module: sorted(n for n in names if _under(n, forbidden) and not _under(n, (module,)))
              for module, names in _modules(package).items()}
    assert not {m: n for m, n in broken.items() if n}, f"{package} may not import {forbidden}"


def _project_files() -> dict[str, Path]:
    # Hidden folders are not the project's code: bench/.venv-litserve and bench/.venv-formats hold whole venvs.
    return {_module_name(f): f for package in PACKAGES for f in sorted((ROOT / package).rglob("*.py"))
            if not any(part.startswith(".") for part in f.relative_to(ROOT).parts)}


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The project modules one import statement loads: ``from pkg import name`` is pkg.name where that is a module,
    else pkg; relative imports are resolved against ``module``."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names} & known
    base = node.module or ""
    if node.level:
        parts = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
        base = ".".join([*parts, *([base] if base else [])])
    found = {f"{base}.{alias.name}" for alias in node.names} & known
    return found | ({base} & known if len(found) < len(node.names) else set())


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports, at module level, inside functions (those run too) and under
    ``if TYPE_CHECKING:`` (they never run, but the modules still depend on each other: a circle hidden there is a
    circle). Its own packages are left out: Python runs a package's __init__ before any module in it, whoever
    imports what."""
    known = set(files)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        edges: set[str] = set()
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _targets(node, module, path.name == "__init__.py", known)
        graph[module] = {t for t in edges if t != module and not module.startswith(t + ".")}
    return graph


@functools.cache
def _project_graph() -> dict[str, set[str]]:
    """The project's import graph, made once a test process."""
    return import_graph(_project_files())


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, in sorted order so the answer is stable)."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if cycle := visit(target):
                return cycle
        path.pop()
        done.add(module)
        return None

    return next((cycle for module in sorted(graph) if (cycle := visit(module))), None)


def test_no_import_cycle_anywhere() -> None:
    # A cycle hidden by imports inside functions still ties the modules together: bench's training benchmarks had
    # one (train -> checks -> train) until their shared step moved to bench/training/trainer.py.
    cycle = find_cycle(_project_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_check_sees_cycles_through_function_level_and_relative_imports(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import run\n")
    (tmp_path / "pkg" / "b.py").write_text("def run():\n    from . import a\n")
    (tmp_path / "pkg" / "c.py").write_text("from pkg import a, b\n")
    files = {f"pkg.{name}": tmp_path / "pkg" / f"{name}.py" for name in ("a", "b", "c")}
    graph = import_graph(files)
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a", "pkg.b"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
    assert find_cycle({"x": {"y"}, "y": set()}) is None
    guarded = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n"
    (tmp_path / "pkg" / "__init__.py").write_text(guarded)
    (tmp_path / "pkg" / "c.py").write_text("from pkg import a\nimport pkg\n")
    files["pkg"] = tmp_path / "pkg" / "__init__.py"
    assert import_graph(files)["pkg"] == {"pkg.c"} and import_graph(files)["pkg.c"] == {"pkg.a"}
    # A circle closed only under TYPE_CHECKING is still a circle: the two modules cannot be understood apart.
    (tmp_path / "pkg" / "d.py").write_text(guarded.replace("from pkg import c", "from pkg.e import E"))
    (tmp_path / "pkg" / "e.py").write_text("from pkg.d import run\n")
    files.update({f"pkg.{name}": tmp_path / "pkg" / f"{name}.py" for name in ("d", "e")})
    assert find_cycle({m: g for m, g in import_graph(files).items() if m in ("pkg.d", "pkg.e")}) == [
        "pkg.d", "pkg.e", "pkg.d"]


def test_the_server_imports_only_the_serving_contract_of_models() -> None:
    # app/ reaches models/ through the modules models.SERVING_CONTRACT names, and those import only each other:
    # the server never loads the training loop, and a change elsewhere in models/ cannot change what it runs.
    from models import SERVING_CONTRACT

    outside = {module: sorted(n for n in names if _under(n, ("models",)) and not _under(n, SERVING_CONTRACT))
               for module, names in _modules("app").items()}
    assert not {m: n for m, n in outside.items() if n}, f"app/ may import only {SERVING_CONTRACT} of models/"
    for name in SERVING_CONTRACT:
        path = ROOT.joinpath(*name.split(".")).with_suffix(".py")
        assert path.is_file(), f"{name} is named in SERVING_CONTRACT but is not a module"
        leaks = sorted(n for n in _imports(path) if _under(n, ("models",)) and not _under(n, SERVING_CONTRACT))
        assert not leaks, f"{name} is in the serving contract and imports {leaks}"


# The engine's wings, lowest first: each imports only the wings before it (and the engine's top-level modules,
# service.py, call.py, explain.py and catalog.py, import any wing). docs/architecture.md draws the same order.
WINGS = ("decoding", "batching", "loaded", "rollouts", "versions")
ENGINE_FACADE = ("app.engine.service", "app.engine.call", "app.engine.explain", "app.engine.catalog",
                 "app.engine.contract")
# contract.py sits between batching and the wings above it: it imports only these of the engine, and any wing from
# loaded up may import it (the data a loaded version and the repository index hand out), and ranking.py (numpy
# only: the answers' top classes, a monitor's top-1) and lifecycle.py (a service's life: arrivals' in-flight count
# of the engine) beside it.
CONTRACT_IMPORTS = ("app.engine.batching.types", "app.engine.batching.arrivals", "app.engine.ranking")
BESIDE_THE_CONTRACT = ("app.engine.contract", "app.engine.lifecycle", "app.engine.ranking")
# app/'s root: what is truly shared, and the two files a newcomer looks for first (wsgi.py, factory.py).
ROOT_MODULES = ["__init__.py", "config.py", "configdoc.py", "errors.py", "factory.py", "logs.py", "metrics.py",
                "metricsdoc.py", "wsgi.py"]
ROOMS = ["engine", "hosting", "link", "v1", "v2", "web"]


def test_app_s_root_holds_the_shared_modules_and_the_rooms() -> None:
    assert sorted(p.name for p in APP.glob("*.py")) == ROOT_MODULES
    assert sorted(p.name for p in APP.iterdir() if p.is_dir() and p.name != "__pycache__") == ROOMS


def test_the_http_side_reaches_the_engine_only_through_its_contract() -> None:
    for package in HTTP_SIDE:
        for module, names in _modules(package).items():
            inside = [n for n in names if _under(n, ("app.engine",)) and not _under(n, ENGINE_FOR_THE_HTTP_SIDE)
                      and n != "app.engine"]
            assert not inside, f"{module} is on the HTTP side and reaches into the engine: {inside}"
    graph = _project_graph()
    contract = sorted(t for t in graph["app.engine.contract"] if _under(t, ("app.engine",)))
    assert set(contract) <= set(CONTRACT_IMPORTS), f"app.engine.contract imports {contract}"
    lifecycle = sorted(t for t in graph["app.engine.lifecycle"] if _under(t, ("app.engine",)))
    assert lifecycle == ["app.engine.batching.arrivals"], f"app.engine.lifecycle imports {lifecycle}"
    ranking = sorted(t for t in graph["app.engine.ranking"] if t.startswith("app"))
    assert not ranking, f"app.engine.ranking imports {ranking}"


def test_engine_is_in_wings_and_they_import_downwards_only() -> None:
    loose = sorted(p.name for p in (APP / "engine").glob("*.py") if p.name != "__init__.py")
    assert loose == ["call.py", "catalog.py", "contract.py", "explain.py", "lifecycle.py", "ranking.py",
                     "service.py"], \
        "an engine module belongs in a wing"
    assert sorted(p.name for p in (APP / "engine").iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(WINGS)
    graph = _project_graph()
    for position, wing in enumerate(WINGS):
        allowed = tuple(f"app.engine.{w}" for w in WINGS[: position + 1]) + (
            BESIDE_THE_CONTRACT if position >= WINGS.index("loaded") else ())
        for module in (m for m in graph if _under(m, (f"app.engine.{wing}",))):
            upward = sorted(t for t in graph[module] if _under(t, ("app.engine",)) and not _under(t, allowed)
                            and t != "app.engine")
            assert not upward, f"{module} (wing {wing}) imports {upward}: a wing imports only the wings below it"


def test_protocols_reach_the_engine_only_through_the_service_the_call_and_the_catalog() -> None:
    # Requests go through Service.admit and its Call, everything about models through Service.catalog (plain data):
    # a protocol that chains the batcher, decoding or a loaded version itself can lose the inline path or the
    # arrival count silently, and could not sit in a process apart from the engine.
    for package in (*PROTOCOLS, "app.web"):
        for module, names in _modules(package).items():
            inside = [n for n in names if _under(n, ("app.engine",)) and not _under(n, ENGINE_FACADE)]
            assert not inside, f"{module} reaches into the engine: {inside}"


def test_the_http_side_imports_no_torch() -> None:
    # Under ENGINE=process a gunicorn worker runs the web layer, the protocols and the engine's remote face only:
    # none of it may load torch (the engine's answers, signatures and version facts are plain data).
    code = ("import sys, app.engine.contract, app.engine.lifecycle, app.link.wire, app.link.client, app.link.supervisor, app.factory, "
            "app.web, app.v1, app.v2, app.hosting.worker, app.hosting.drain, app.hosting.starting; bad = [m for m in ('torch', 'torchvision') if m in sys.modules]; print(bad); "
            "sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_importing_the_engine_loads_no_flask() -> None:
    code = ("import sys, app.engine.service, app.engine.loaded.predictor; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('flask', 'werkzeug') "
            "or m.startswith(('app.web', 'app.v1', 'app.v2'))]; print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_gunicorn_master_imports_neither_torch_nor_flask() -> None:
    code = ("import runpy, sys; runpy.run_path('gunicorn.conf.py'); "
            "bad = [m for m in ('torch', 'flask') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("folder", ["app", "visionserve_client"])
def test_no_function_is_longer_than_50_lines(folder: str) -> None:
    long = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long


def test_metrics_doc_is_generated_from_the_metrics() -> None:
    # Before: five of them (the GPU memory the dashboard reads, the rejections, explanations and rollout changes)
    # were named nowhere in the docs (an operator's trial)
    assert metricsdoc.DOC.read_text(encoding="utf-8") == metricsdoc.render(), \
        "docs/metrics.md is out of date: run `python -m app.metricsdoc`"
    assert metricsdoc.main(["--check"]) == 0
    assert len(metricsdoc.declared()) == metricsdoc.render().count("\n| `visionserve_")
    # a histogram's buckets said (a p99 objective between two is read by interpolation: a capacity planner's trial)
    assert "Buckets (`le`): 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30 |" in \
        metricsdoc.render().split("visionserve_request_duration_seconds")[1].splitlines()[0]


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


# -- docs/architecture.md names what is there ------------------------------------------------------------------------

_CODE_SPAN = r"`([^`\n]+)`"
_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+"


def _members(tree: ast.Module) -> dict[str, set[str] | None]:
    """A module's top-level names; a class's are the set of its methods, class attributes and ``self.x``s."""
    names: dict[str, set[str] | None] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            members = set()
            for inner in ast.walk(node):
                if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members.add(inner.name)
                elif isinstance(inner, ast.AnnAssign) and isinstance(inner.target, ast.Name):
                    members.add(inner.target.id)
                elif isinstance(inner, ast.Assign):
                    members.update(t.id for t in inner.targets if isinstance(t, ast.Name))
                if isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name) and inner.value.id == "self":
                    members.add(inner.attr)
            names[node.name] = members
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = None
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        names[name.id] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(a.asname or a.name).split(".")[0]: None for a in node.names})
    return names


def _resolves(dotted: str, modules: dict[str, dict[str, set[str] | None]]) -> bool | None:
    """Whether ``dotted`` names something of the project (None: it does not start with anything of it)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):  # the longest module prefix: app.engine.contract.ServiceFace
        if ".".join(parts[:cut]) in modules:
            return _inside(modules[".".join(parts[:cut])], parts[cut:], modules, ".".join(parts[:cut]))
    owners = [m for m in modules if m.rsplit(".", 1)[-1] == parts[0]]  # a module by its last name: wire.Infer
    owners += [m for m, names in modules.items() if isinstance(names.get(parts[0]), set)]  # a class: Service.admit
    if not owners:
        return None
    return any(_inside(modules[m], parts[1:] if m.rsplit(".", 1)[-1] == parts[0] else parts, modules, m)
               for m in owners)


def _inside(names: dict[str, set[str] | None], rest: list[str], modules: dict[str, dict[str, set[str] | None]],
            module: str) -> bool:
    if not rest:
        return True
    if f"{module}.{rest[0]}" in modules:  # a submodule: models.export.load
        return _inside(modules[f"{module}.{rest[0]}"], rest[1:], modules, f"{module}.{rest[0]}")
    if rest[0] not in names:
        return False
    members = names[rest[0]]
    return len(rest) == 1 or (members is not None and rest[1] in members and len(rest) == 2)


def test_every_module_path_and_dotted_name_in_the_architecture_page_resolves() -> None:
    import re

    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    files = {module: path for module, path in _project_files().items()}
    modules = {module: _members(_tree(path)) for module, path in files.items()}
    all_paths = [str(p.relative_to(ROOT)) for p in files.values()]
    missing_paths, unresolved = [], []
    for span in re.findall(_CODE_SPAN, page):
        for path in re.findall(r"[\w./-]+\.py\b", span):
            if not (ROOT / path).is_file() and not [p for p in all_paths if p.endswith("/" + path)]:
                missing_paths.append(path)
        if "/" in span or " " in span.strip():
            continue
        for dotted in re.findall(_DOTTED, span.rstrip("()")):
            if not dotted.endswith(".py") and _resolves(dotted, modules) is False:
                unresolved.append(dotted)
    assert not missing_paths, f"docs/architecture.md names files that are not there: {sorted(set(missing_paths))}"
    assert not unresolved, f"docs/architecture.md names what the code lacks: {sorted(set(unresolved))}"


def test_the_name_check_catches_a_stale_name() -> None:
    modules = {"app.engine.call": _members(ast.parse("class Call:\n    def __init__(self):\n        self.model = 1\n"
                                                     "    def infer(self): ...\n"))}
    assert _resolves("Call.infer", modules) and _resolves("Call.model", modules)
    assert _resolves("Call.version", modules) is False and _resolves("call.Call.run", modules) is False
    assert _resolves("torch.topk", modules) is None
