"""docs/training.md and docs/models.md run whole: every ```bash block, in order, as printed, on tiny data (train,
export, evaluate and score with models.predict on one process and two, serve, train again into the repository as
version 2 while the server polls, the default model, a rollback that holds through polls, rolling out a version:
canary, shadow, promotion, rollback), so the docs and the code cannot part; what the commands print is checked too,
and the commands training prints to run next are the docs' own (so they run as printed).

How a command runs: from a scratch folder holding `data/mine` (the demo set's layout and format: train/ and val/ of
three classes of small PNG photos), `cat.jpg` and `.venv` (this interpreter's environment, linked), so
`.venv/bin/python` and `.venv/bin/torchrun` run as printed, and what the scripts print names `.venv/bin/python`
as it would in the project's folder; a bare `python` is this interpreter;
`[VAR=value ...] make serve` starts the server (bin/serve, as `make serve` does) with those settings on a free port,
stopping the one before; `localhost:8000` is that server. While a polling server runs, each command that changes what
is served (one that writes into the repository, or a load, unload, promote or rollback call) is followed by one poll
interval (every worker reads what the command wrote, e.g. repository.json) and a wait until the repository's newest
versions are served or refused; one that only reads (a prediction, a listing) by READ_PAUSE_S, the moment a person
takes to read its answer (what the workers share every second, such as shadow comparisons, is then shared).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import requests
import skimage.data
from PIL import Image

from harness.servers import ROOT, Running, visionserve
from tests.server.test_docs_commands import shell_commands
from tests.support.fakes import wait_until

WALKTHROUGHS = ("docs/training.md", "docs/models.md")
MAKE_SERVE = re.compile(r"^((?:[A-Z_]+=\S+\s+)*)make serve$")
CLASSES = {"red": (200, 40, 40), "green": (40, 180, 60), "blue": (40, 60, 200)}
READ_PAUSE_S = 2.0
# A command that writes into the repository folder (a path, --repository, --export-repository) or asks for a change.
CHANGES_SERVING = re.compile(r"(?:^|[\s>])repository/|--(?:export-)?repository\s|/(?:load|unload|promote|rollback)\b")


def walkthrough_commands() -> list[tuple[str, str]]:
    """(doc, command) for every command of the walkthrough docs, in order."""
    return [(doc, command) for doc in WALKTHROUGHS
            for command in shell_commands((ROOT / doc).read_text(encoding="utf-8"))]


SPLITS = {"train": 4, "val": 2}  # images per class


def _tiny_data(work: Path) -> None:
    """data/mine as `python -m demo_data textures` lays it out (train/ and val/, PNGs): three colour classes of noisy
    64x64 photos; cat.jpg; and .venv, so the commands' `.venv/bin/python` is this interpreter."""
    rng = np.random.default_rng(0)
    for split, count in SPLITS.items():
        for name, colour in CLASSES.items():
            folder = work / "data" / "mine" / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = np.clip(np.array(colour) + rng.normal(0, 30, (64, 64, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{name}_{i:05d}.png")
    Image.fromarray(skimage.data.chelsea()).save(work / "cat.jpg", quality=90)
    if sys.prefix != sys.base_prefix:  # a venv: the whole environment (its pyvenv.cfg finds its packages)
        (work / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    else:  # an interpreter of its own: .venv/bin/python is it, torchrun its module
        bin_dir = work / ".venv" / "bin"
        bin_dir.mkdir(parents=True)
        (bin_dir / "python").symlink_to(sys.executable)
        (bin_dir / "torchrun").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m torch.distributed.run "$@"\n')
        (bin_dir / "torchrun").chmod(0o755)


def _uncommented(command: str) -> str:
    """A docs command without its trailing comment."""
    return re.sub(r"\s+#[^'\"]*$", "", command.strip())


class Walk:
    """The scratch folder, the server the docs started last, and how a command is run there."""

    def __init__(self, work: Path) -> None:
        self.work, self.server, self.poll_s = work, None, 0.0  # type: Path, Running | None, float
        self.started = 0
        self.seconds: list[tuple[float, str]] = []  # each command's wall time, printed by the test (-s shows it)
        self.printed: dict[str, str] = {}  # each command's stdout and stderr: what a person sees at the terminal

    def serve(self, assignments: str) -> None:
        if self.server is not None:
            self.server.stop()
        settings = dict(a.split("=", 1) for a in assignments.split())
        weights = self.work / settings.pop("VISIONSERVE_WEIGHTS_DIR", "weights")
        self.poll_s = float(settings.get("VISIONSERVE_REPOSITORY_POLL_S", 0))
        log_dir = self.work / f"server-{self.started}"
        log_dir.mkdir()
        self.started += 1
        self.server = visionserve(weights, log_dir, log_level="info",
                                  **{k.removeprefix("VISIONSERVE_").lower(): v for k, v in settings.items()})
        self.server.wait_ready()

    def run(self, doc: str, command: str) -> str:
        started = time.perf_counter()
        try:
            return self._run(doc, command)
        finally:
            self.seconds.append((time.perf_counter() - started, command.strip().splitlines()[0][:100]))

    def _run(self, doc: str, command: str) -> str:
        serve = MAKE_SERVE.match(command.strip())
        if serve:
            self.serve(serve.group(1))
            return ""
        aimed = re.sub(r"(^|[|;&(]\s*)python3? ", lambda m: m.group(1) + sys.executable + " ", command, flags=re.M)
        if self.server is not None:
            aimed = aimed.replace("localhost:8000", f"127.0.0.1:{self.server.port}")
        result = subprocess.run(["bash", "-o", "pipefail", "-c", aimed], cwd=self.work, capture_output=True,
                                text=True, timeout=600,
                                env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
        log = self.server.output()[-3000:] if self.server is not None else ""
        self.printed[command] = result.stdout + result.stderr
        assert result.returncode == 0, f"{doc}: {command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}\n{log}"
        if self.poll_s:  # as a person at a terminal: a change waits until every worker has polled once
            time.sleep(self.poll_s if CHANGES_SERVING.search(command) else READ_PAUSE_S)
            wait_until(self._repository_settled, timeout=120)
        return result.stdout

    def _repository_settled(self) -> bool:
        """Every model's newest version in the repository is served or refused (none still loading)."""
        assert self.server is not None
        rows = requests.post(self.server.url + "/v2/repository/index", timeout=10).json()
        newest: dict[str, dict] = {}
        for row in rows:
            if row["version"].isdigit() and int(row["version"]) >= int(newest.get(row["name"], {"version": 0})[
                    "version"]):
                newest[row["name"]] = row
        return all(row["state"] in ("READY", "UNAVAILABLE") for row in newest.values()) and not any(
            row["state"] == "LOADING" for row in rows)

    def unnamed(self) -> dict:
        assert self.server is not None
        answer = requests.post(self.server.url + "/predict", data=(self.work / "cat.jpg").read_bytes(),
                               headers={"Content-Type": "image/jpeg"}, timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json()["model"]


@pytest.fixture
def walk(tmp_path: Path) -> Iterator[Walk]:
    _tiny_data(tmp_path)
    walk = Walk(tmp_path)
    yield walk
    if walk.server is not None:
        walk.server.stop()


def test_every_walkthrough_command_is_found() -> None:
    commands = [command for _, command in walkthrough_commands()]
    # A fresh shell's python lacks torch: every command of docs/training.md, in its blocks or its prose (headings
    # and the other machines' ```text blocks aside), runs the project's .venv.
    training = re.sub(r"^```text\n.*?^```", "", (ROOT / "docs" / "training.md").read_text(encoding="utf-8"),
                      flags=re.S | re.M)
    bare = [line for line in training.splitlines() if not line.startswith("#")
            and re.search(r"(?<![\w/])(python3? -m |torchrun --)", line)]
    assert not bare, bare
    assert sum("models.train" in c for c in commands) >= 4 and sum(bool(MAKE_SERVE.match(c)) for c in commands) == 2
    assert any("--name mine" in c and "--export-repository repository" in c for c in commands)  # version 2
    predict = [c for c in commands if "-m models.predict" in c]
    assert any("--labels" in c for c in predict) and any("torchrun" in c for c in predict)  # evaluating and scoring
    # the poll's wait follows what changes the repository or the served versions, and nothing that only reads
    changing = [c.split()[-1] for c in commands if CHANGES_SERVING.search(c) and c.startswith("curl")]
    assert {"localhost:8000/v1/models/mine/promote", "localhost:8000/v1/models/mine/rollback"} <= set(changing)
    assert any(CHANGES_SERVING.search(c) for c in commands if c.startswith("echo") and "repository.json" in c)
    assert not [c for c in commands if CHANGES_SERVING.search(c) and ("/predict" in c or "/index" in c)]


def _printed(walk: Walk, *fragments: str) -> str:
    """What the one docs command holding every fragment printed."""
    (text,) = [text for command, text in walk.printed.items() if all(f in command for f in fragments)]
    return text


def _check_training_and_scoring_output(walk: Walk, commands: list[str]) -> None:
    """docs/training.md's commands print what a person needs: training's summary names the docs' own next commands
    (run as printed: the same words), the export its time and agreement, models.predict what it wrote and the
    evaluation's report folder."""
    docs = {_uncommented(command) for command in commands}
    trained = _printed(walk, "-m models.train --data data/mine --pretrained --freeze-backbone")
    done = re.search(r"done: best epoch (\d), val top-1 [\d.]+ \(loss [\d.]+\); 5 epochs in \w+, \w+ in all$",
                     trained, flags=re.M)
    assert done, trained[-2000:]
    export = re.search(r"export: (.*)$", trained, flags=re.M)
    serve = re.search(r"serve:  (.*)$", trained, flags=re.M)
    assert export and serve, trained[-2000:]
    assert export.group(1) == ".venv/bin/python -m models.export --checkpoint runs/mine/best.pt --out runs/mine/export"
    assert {export.group(1), serve.group(1)} <= docs  # the docs' next commands, word for word: they ran as printed
    manifest = json.loads((walk.work / "runs" / "mine" / "export" / "manifest.json").read_text())
    assert manifest["source"] == f"models.train checkpoint best.pt of run mine, epoch {done.group(1)}"  # from 1
    exported = _printed(walk, "-m models.export --checkpoint runs/mine/best.pt --out runs/mine/export")
    assert re.search(r"wrote model\.onnx in \d+s: top-1 agrees with the model on [\d.]+% of 198 photos, "
                     r"probabilities within \d\.\de[-+]\d\d$", exported, flags=re.M), exported[-2000:]
    val, every = 3 * SPLITS["val"], 3 * sum(SPLITS.values())
    evaluated = _printed(walk, "--labels data/mine/val --out runs/mine/eval.jsonl")
    assert f"wrote runs/mine/eval.jsonl: {val} lines, 0 of them unreadable files" in evaluated
    assert re.search(rf"evaluated {val} images: top-1 [\d.]+ \(0 unreadable, 0 without a label\); "
                     r"report in runs/mine/eval-report$", evaluated, flags=re.M), evaluated[-2000:]
    report = walk.work / "runs" / "mine" / "eval-report"
    metrics = json.loads((report / "metrics.json").read_text())
    assert metrics["count"] == val and metrics["acc5"] is None  # 3 classes: no top-5, as training says
    assert (report / "mistakes.html").is_file() and (report / "confusion.png").is_file()
    assert f"wrote runs/mine/scores.csv: {every} lines, 0 of them unreadable files" in _printed(walk, "scores.csv --")
    assert f"wrote runs/mine/scores-2.csv: {every} lines" in _printed(walk, "torchrun", "scores-2.csv")
    assert (walk.work / "list.txt").read_text().count(".png\n") == val
    assert f"wrote runs/mine/list.jsonl: {val} lines, 0 of them unreadable files" in _printed(walk, "list.jsonl")
    ddp = _printed(walk, "torchrun", "-m models.train")
    assert re.search(r"export: \S+ -m models\.export --checkpoint runs/ddp/best\.pt --out runs/ddp/export$", ddp,
                     flags=re.M), ddp[-2000:]


def _walked(walk: Walk, doc: str) -> tuple[list[str], dict[str, str]]:
    """Every command of ``doc``, in order, run in the walk's folder: the commands and what each printed."""
    outputs = {}
    commands = [command for in_doc, command in walkthrough_commands() if in_doc == doc]
    for command in commands:
        outputs[command] = walk.run(doc, command)
    print("\n".join(f"{seconds:6.1f} s  {command}" for seconds, command in sorted(walk.seconds, reverse=True)))
    return commands, outputs


# Each doc in a folder of its own (neither reads what the other writes), so the two run side by side.
@pytest.mark.slow
def test_the_training_doc_runs_end_to_end(walk: Walk) -> None:
    commands, _ = _walked(walk, "docs/training.md")
    _check_training_and_scoring_output(walk, commands)
    assert (walk.work / "runs" / "mine" / "export" / "manifest.json").is_file()
    assert (walk.work / "runs" / "ddp" / "best.pt").is_file()


@pytest.mark.slow
def test_the_models_doc_runs_end_to_end(walk: Walk) -> None:
    _, outputs = _walked(walk, "docs/models.md")
    repository = walk.work / "repository"
    assert sorted(p.parent.name for p in (repository / "mine").glob("*/manifest.json")) == ["1", "2"]
    assert walk.unnamed() == {"name": "mine", "version": "1"}  # the default model, rolled back by a call
    time.sleep(2 * walk.poll_s)  # two polls: the rollback holds
    assert walk.unnamed() == {"name": "mine", "version": "1"}
    models = requests.get(walk.server.url + "/v1/models", timeout=10).json()  # type: ignore[union-attr]
    assert models["default_model"] == "mine"
    assert {(m["name"], m["version"]) for m in models["models"]} >= {("mine", "1"), ("efficientnet_lite0", "1")}
    # rolling out a version: 2 was the candidate (canary and shadow), promoted, then rolled back
    rollout = next(r for r in models["rollouts"] if r["model"] == "mine")
    assert (rollout["live"], rollout.get("candidate"), rollout["rolled_back"]) == ("1", None, ["2"])
    promoted = next(json.loads(out) for command, out in outputs.items() if command.endswith("/mine/promote"))
    assert (promoted["default"], promoted["previous"]) == ("2", "1")
    evidence = next(out for command, out in outputs.items() if 'body["rollouts"]' in command)
    assert "{'1': 'live', '2': 'canary'}" in evidence and '"top1_agreement"' in evidence
