"""Model versions under real gunicorn (#20): a swap under load from 8 clients with 1 and 2 workers (no failed or
hung request, the version in each connection's answers changes once and never goes back), a corrupt version
refused while the old one serves, unload, the 404s, two models side by side, all through tritonclient's
repository calls."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
import requests
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from app import EXTENSION_KEY

from app.factory import create_app
from app.config import Settings
from harness.servers import Running
from models.export.manifest import read_manifest
from tests.support.fakes import export_tiny, wait_until
from tests.support.imaging import BLUE, GREEN, RED, image_bytes

CLIENTS = 8
PHOTOS = [image_bytes(colour, size=(64, 48)) for colour in (RED, GREEN, BLUE)]


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """mine 1 and 2, other 1 (other weights), and a corrupt mine 3, exported once and copied into each repository."""
    root = tmp_path_factory.mktemp("exports")
    export_tiny(root / "mine" / "1")
    export_tiny(root / "mine" / "2", version="2", seed=1)
    export_tiny(root / "other" / "1", name="other", seed=2)
    corrupt = export_tiny(root / "mine" / "3", version="3", seed=3)
    torchscript = corrupt / read_manifest(corrupt).files["torchscript"].path
    torchscript.write_bytes(torchscript.read_bytes()[:-100])  # cut short: its sha256 no longer matches
    return root


def _add(exports: Path, repository: Path, name: str, version: str) -> None:
    import shutil

    shutil.copytree(exports / name / version, repository / name / version)


class Load:
    """CLIENTS threads posting photos on their own kept-alive connections; each records (status, version)."""

    def __init__(self, url: str, model: str = "mine") -> None:
        self.url = f"{url}/predict?model={model}"
        self.answers: list[list[tuple[int, str]]] = [[] for _ in range(CLIENTS)]
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(CLIENTS)]

    def _client(self, index: int) -> None:
        with requests.Session() as session:
            while not self._stop.is_set():
                try:
                    answer = session.post(self.url, data=PHOTOS[index % 3], headers={"Content-Type": "image/jpeg"},
                                          timeout=30)
                    version = answer.json()["model"]["version"] if answer.ok else answer.text
                    self.answers[index].append((answer.status_code, version))
                except requests.RequestException as exc:  # a hung or reset request is a failure too
                    self.answers[index].append((0, repr(exc)))

    def __enter__(self) -> "Load":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def versions_seen(self) -> set[str]:
        return {version for answers in self.answers for _, version in answers}

    def check(self, before: str, after: str) -> int:
        """Every answer 200, and each connection's versions ``before``... then ``after``...; returns the total."""
        for answers in self.answers:
            assert all(status == 200 for status, _ in answers), [a for a in answers if a[0] != 200][:3]
            versions = [version for _, version in answers]
            switched = versions.index(after) if after in versions else len(versions)
            assert set(versions[:switched]) <= {before} and set(versions[switched:]) <= {after}, versions
        return sum(map(len, self.answers))


def _all_ready(server: Running, workers: int) -> Running:
    """Wait until every worker has loaded (each reports what it serves), not only the first to answer /readyz."""
    server.wait_ready()
    wait_until(lambda: len(requests.get(server.url + "/v1/models", timeout=10).json().get("workers", [])) == workers,
               timeout=120)  # a worker still loading answers 503
    return server


@pytest.fixture
def repository(tmp_path: Path, exports: Path) -> Path:
    repository = tmp_path / "repository"
    _add(exports, repository, "mine", "1")
    return repository


@pytest.mark.parametrize("workers, how, engines", [("1", "poll", 0), ("2", "load call", 2)])
def test_a_version_swap_under_load_fails_no_request(start_server: Callable[..., Running], repository: Path,
                                                    exports: Path, workers: str, how: str, engines: int) -> None:
    # engines=2: ENGINE=process with two engines, each behind one HTTP worker; the load call reaches one of them
    # and answers once both serve version 2 ("workers" below are then the engines). Inline workers take a load
    # call's change the same way (the desired state in CONTROL_DIR): test_two_models_three_versions_... below.
    poll = "0.5" if how == "poll" else "0"
    two_engines = {"engine": "process", "engines_per_device": str(engines)} if engines else {}
    server = _all_ready(start_server(repository, workers=workers, repository_poll_s=poll, max_wait_ms="5",
                                     **two_engines), int(workers))
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    with Load(server.url) as load:
        wait_until(lambda: min(map(len, load.answers)) >= 5, timeout=60)
        _add(exports, repository, "mine", "2")
        if how == "load call":
            client.load_model("mine")  # answers once every worker serves version 2
        wait_until(lambda: all(answers and answers[-1][1] == "2" for answers in load.answers), timeout=60)
        wait_until(lambda: min(len(answers) for answers in load.answers) >= 20, timeout=60)
    total = load.check("1", "2")
    workers_now = requests.get(server.url + "/v1/models", timeout=10).json()["workers"]
    assert len(workers_now) == int(workers) and all(w["models"] == {"mine": {"versions": ["2"], "default": "2"}}
                                                    for w in workers_now)
    assert [(m["name"], m["version"], m["state"]) for m in client.get_model_repository_index()] == [
        ("mine", "1", "UNAVAILABLE"), ("mine", "2", "READY")]
    print(f"{workers} worker(s), {engines or 'no'} engine process(es), {how}: {total} answers, all 200, each "
          "connection 1 -> 2 once")


@pytest.fixture
def two_models(start_server: Callable[..., Running], repository: Path, exports: Path) -> Iterator[Running]:
    _add(exports, repository, "other", "1")
    yield _all_ready(start_server(repository, workers="2", max_wait_ms="5"), 2)


def _alone(folder: Path, photo: bytes) -> dict:
    app = create_app(Settings(weights_dir=folder, device="cpu", log_level="warning"))
    try:
        return app.test_client().post("/predict?top_k=3", data=photo, content_type="image/jpeg").get_json()
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=10)


def test_two_models_answer_as_each_served_alone(two_models: Running, exports: Path) -> None:
    for name in ("mine", "other"):
        answer = requests.post(f"{two_models.url}/predict?model={name}&top_k=3", data=PHOTOS[0],
                               headers={"Content-Type": "image/jpeg"}, timeout=30).json()
        assert answer == _alone(exports / name / "1", PHOTOS[0])
    unnamed = requests.post(f"{two_models.url}/predict", data=PHOTOS[0], headers={"Content-Type": "image/jpeg"},
                            timeout=30)
    assert unnamed.status_code == 400 and "name one" in unnamed.json()["error"]["message"]
    for url, status in (("/predict?model=nope", 404), ("/predict?model=mine&version=9", 404),
                        ("/v2/models/nope/infer", 404)):
        answer = requests.post(two_models.url + url, data=PHOTOS[0], headers={"Content-Type": "image/jpeg"},
                               timeout=30)
        assert answer.status_code == status, (url, answer.text)
        assert "this server serves 'mine' version '1', 'other' version '1'" in answer.text


def test_a_corrupt_version_is_refused_while_the_old_one_serves_then_unload(two_models: Running, repository: Path,
                                                                            exports: Path) -> None:
    client = triton.InferenceServerClient(two_models.url.removeprefix("http://"))
    _add(exports, repository, "mine", "3")
    with Load(two_models.url) as load:
        wait_until(lambda: min(map(len, load.answers)) >= 3, timeout=60)
        with pytest.raises(InferenceServerException, match="mine version 3 cannot be served: weights file .* has "
                                                           "sha256"):
            client.load_model("mine")
        wait_until(lambda: min(map(len, load.answers)) >= 10, timeout=60)
    load.check("1", "1")
    assert load.versions_seen() == {"1"}
    index = {(m["name"], m["version"]): m for m in client.get_model_repository_index()}
    assert index[("mine", "3")]["state"] == "UNAVAILABLE" and "sha256" in index[("mine", "3")]["reason"]
    assert index[("mine", "1")]["state"] == "READY" and client.is_model_ready("mine")

    client.unload_model("other")  # every worker: none answers for it any more
    for _ in range(10):
        assert requests.post(f"{two_models.url}/predict?model=other", data=PHOTOS[0],
                             headers={"Content-Type": "image/jpeg"}, timeout=30).status_code == 404
    assert not client.is_model_ready("other") and client.is_model_ready("mine")
    with pytest.raises(InferenceServerException, match="no model 'nope'"):
        client.load_model("nope")
    client.load_model("other")
    assert client.is_model_ready("other")


def _unnamed_version(url: str) -> tuple[str, str]:
    answer = requests.post(f"{url}/predict", data=PHOTOS[0], headers={"Content-Type": "image/jpeg"}, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()["model"]["name"], answer.json()["model"]["version"]


def _workers(url: str) -> list[dict]:
    """What each worker serves; none while the worker that answers is still loading (503)."""
    return requests.get(url + "/v1/models", timeout=10).json().get("workers", [])


def _defaults(url: str) -> list[str]:
    return [w["models"]["mine"]["default"] for w in _workers(url)]


def test_two_models_three_versions_one_corrupt_a_default_model_and_a_rollback_that_holds(
        start_server: Callable[..., Running], repository: Path, exports: Path) -> None:
    # Before: the corrupt newest version stopped the start, requests naming no model were a 400, and the next
    # poll undid a rollback.
    for name, version in (("mine", "2"), ("mine", "3"), ("other", "1")):
        _add(exports, repository, name, version)
    (repository / "repository.json").write_text('{"default_model": "mine"}')
    server = _all_ready(start_server(repository, workers="2", repository_poll_s="0.3", max_wait_ms="5"), 2)
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    index = {(m["name"], m["version"]): m for m in client.get_model_repository_index()}
    assert index[("mine", "3")]["state"] == "UNAVAILABLE" and "sha256" in index[("mine", "3")]["reason"]
    assert index[("mine", "2")]["default"] and requests.get(server.url + "/v1/models").json()["default_model"] == \
        "mine"
    assert _unnamed_version(server.url) == ("mine", "2")

    client.load_model("mine", config='{"default_version": "1"}')  # the rollback, in every worker
    time.sleep(1.5)  # five polls
    assert _defaults(server.url) == ["1", "1"] and _unnamed_version(server.url) == ("mine", "1")
    killed = _workers(server.url)[0]["pid"]
    os.kill(killed, signal.SIGKILL)  # gunicorn starts a new worker: it serves the desired state, rollback included
    seen: list[dict] = []  # one answer that lists both workers, the new one included (a next request may reach
    # the new worker while it still loads: 503, no workers listed)

    def restarted() -> bool:
        seen[:] = _workers(server.url)
        return len(seen) == 2 and killed not in [w["pid"] for w in seen]

    wait_until(restarted, timeout=120)
    assert [w["models"]["mine"]["default"] for w in seen] == ["1", "1"]
    # The new worker's report lists it as soon as its models are applied, a moment before it takes requests: until
    # then it answers 503 with Retry-After, as a worker still loading does (the load balancer's readiness waits)
    answers: list[requests.Response] = []

    def other_answered() -> bool:
        answers.append(requests.post(f"{server.url}/predict?model=other", data=PHOTOS[1],
                                     headers={"Content-Type": "image/jpeg"}, timeout=30))
        assert answers[-1].status_code in (200, 503), answers[-1].text
        if answers[-1].status_code == 503:
            time.sleep(0.1)
        return answers[-1].status_code == 200

    wait_until(other_answered, timeout=60)
    assert answers[-1].json()["model"] == {"name": "other", "version": "1"}
    assert all(a.headers.get("Retry-After") for a in answers[:-1])
