"""Rollouts under real gunicorn with two real versions (#33): the packaged EfficientNet-Lite0 (1) and a copy with a
perturbed head (2), on real photos. With 1 and 2 workers: a 100% shadow's agreement, summed over the workers,
equals the agreement `python -m models.predict` computes offline for the same photos, while every live answer
comes from version 1; then a promotion and a rollback under 8 clients, with no failed request."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import requests

from harness.photos import imagenet_workload, workload
from harness.rollouts import MODEL, two_lite0_versions
from harness.servers import ROOT, Running
from tests.support.fakes import wait_until

PHOTOS = list(workload()) + list(imagenet_workload())
CLIENTS = 8


@pytest.fixture(scope="module")
def repository(real_weights: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """<repo>/efficientnet_lite0/1 (the packaged model) and /2 (its head perturbed: it disagrees on some photos),
    with a 100% shadow in policy.json."""
    return two_lite0_versions(tmp_path_factory.mktemp("rollout-repository"), first=real_weights,
                              rollout={"shadow_percent": 100})


def _offline_top1(repository: Path, version: str, photos: Path, out: Path) -> dict[str, str]:
    """Each photo's top-1 label from `python -m models.predict` on ``version`` (the served artefact, in process)."""
    subprocess.run([sys.executable, "-m", "models.predict", "--weights", str(repository), "--model", MODEL,
                    "--version", version, "--data", str(photos), "--out", str(out), "--top-k", "1"],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    return {Path(r["path"]).name: r["labels"][0] for r in records}


@pytest.fixture(scope="module")
def offline_agreement(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> float:
    """The share of PHOTOS on which `python -m models.predict` gives versions 1 and 2 the same top-1 (once for the
    module: it does not depend on how many workers serve)."""
    folder = tmp_path_factory.mktemp("rollout-photos")
    for i, photo in enumerate(PHOTOS):
        (folder / f"{i:02d}.jpg").write_bytes(photo)
    ones, twos = (_offline_top1(repository, v, folder, folder.parent / f"v{v}.jsonl") for v in ("1", "2"))
    return sum(ones[name] == twos[name] for name in ones) / len(ones)


def _workers_serving(server: Running) -> int:
    answer = requests.get(server.url + "/v1/models", timeout=10)
    return len(answer.json()["workers"]) if answer.ok else 0


def _rollout(server: Running) -> dict:
    body = requests.get(server.url + "/v1/models", timeout=10).json()
    return next(r for r in body["rollouts"] if r["model"] == MODEL)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_the_shadow_agreement_equals_the_offline_one_and_promotion_under_load_fails_nothing(
        repository: Path, offline_agreement: float, start_server: Callable[..., Running], workers: str) -> None:
    server = start_server(repository, workers=workers, max_wait_ms="10").wait_ready()
    wait_until(lambda: _workers_serving(server) == int(workers), timeout=120)  # ready answers from one worker only
    with requests.Session() as session:
        for photo in PHOTOS:
            answer = session.post(server.url + "/predict", data=photo, headers={"Content-Type": "image/jpeg"},
                                  timeout=60)
            assert answer.status_code == 200 and answer.json()["model"]["version"] == "1", answer.text
    wait_until(lambda: ((_rollout(server).get("comparison") or {}).get("compared", 0)
                        + sum((_rollout(server).get("comparison") or {}).get("dropped", {}).values())) == len(PHOTOS),
               timeout=120)
    comparison = _rollout(server)["comparison"]
    assert comparison["dropped"] == {} and comparison["errors"] == 0  # one client at a time: nothing is busy

    assert 0 < offline_agreement < 1  # the versions disagree on some photos: the comparison can be told apart
    assert comparison["top1_agreement"] == pytest.approx(offline_agreement)

    answers: list[tuple[int, str]] = []
    sent: list[float] = []  # when each answer's request was sent: on a busy machine answers come back out of order
    stop, lock = threading.Event(), threading.Lock()

    def client(index: int) -> None:
        with requests.Session() as session:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    answer = session.post(server.url + "/predict", data=PHOTOS[index % len(PHOTOS)],
                                          headers={"Content-Type": "image/jpeg"}, timeout=60)
                    answered = (answer.status_code, answer.json()["model"]["version"] if answer.ok else answer.text)
                except requests.RequestException as exc:
                    answered = (0, repr(exc))
                with lock:
                    answers.append(answered)
                    sent.append(started)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(2)
        promoted = requests.post(f"{server.url}/v1/models/{MODEL}/promote", timeout=120)
        assert promoted.status_code == 200 and promoted.json()["default"] == "2", promoted.text
        time.sleep(2)
        rolled = requests.post(f"{server.url}/v1/models/{MODEL}/rollback", timeout=120)
        assert rolled.status_code == 200 and rolled.json()["default"] == "1", rolled.text
        rolled_back = time.monotonic()  # (the call returns once every worker serves version 1 again)
        time.sleep(2)
        # and until each client had a request sent after it answered: in a suite run on a starved machine the
        # requests queued on the promoted version waited 3.7-4.3 s in its queue, every client on one of them, so
        # none was sent in the 2 s after the rollback (bench/results/2026-12-02-suite-f5dfded-cpu-2cpu-vm.md)
        wait_until(lambda: sum(started > rolled_back for started in list(sent)) >= CLIENTS, timeout=120)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    failed = [a for a in answers if a[0] != 200]
    assert not failed, failed[:5]
    assert {version for _, version in answers} == {"1", "2"}
    after = [version for started, (_, version) in zip(sent, answers) if started > rolled_back]
    assert len(after) >= CLIENTS and set(after) == {"1"}, after  # every request sent after the rollback: 1
    rollout = _rollout(server)
    assert (rollout["live"], rollout["rolled_back"]) == ("1", ["2"])
    log = server.output()
    assert '"action": "promote"' in log and '"action": "rollback"' in log
