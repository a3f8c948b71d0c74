"""The model repository on disk: <repository>/<model>/<version>/, written by models.export --repository, served
by pointing VISIONSERVE_WEIGHTS_DIR at it (MODELS chooses; swaps: tests/app/test_model_lifecycle.py and
tests/server/test_model_swaps.py)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from app import EXTENSION_KEY

from app.factory import create_app
from app.config import Settings
from app.engine.versions.sources import DirectorySource
from app.engine.versions.states import NOT_AN_EXPORT
from app.errors import NotFound
from models.export.checks import ModelLoadError
from models.export.repository import models, newest, next_version, stray_folders, versions
from tests.support.fakes import FakeRepository, export_tiny

pytestmark = pytest.mark.slow  # real exports: seconds each


def test_versions_are_ordered_by_number_and_the_next_one_counts_on(tmp_path: Path) -> None:
    for version in ("1", "2", "10", "canary"):
        export_tiny(tmp_path / "mine" / version, version=version)
    (tmp_path / "mine" / "11").mkdir()  # no manifest: not a version
    (tmp_path / "mine" / "12").mkdir()
    (tmp_path / "mine" / "12" / "model.pt").write_bytes(b"a model file copied in by hand")
    assert versions(tmp_path, "mine") == ["1", "2", "10", "canary"]
    assert stray_folders(tmp_path, "mine") == ["12"]  # (11 holds no file: nothing to say of it)
    assert newest(tmp_path, "mine") == "10" and next_version(tmp_path, "mine") == "11"
    assert next_version(tmp_path, "other") == "1" and models(tmp_path) == ["mine"]


def test_a_directory_is_one_export_or_a_repository(tmp_path: Path) -> None:
    single = export_tiny(tmp_path / "weights")
    source = DirectorySource(Settings(weights_dir=single, device="cpu"))
    assert source.models() == ["mine"] and source.versions("mine") == ["1"]  # today's weights/ works unchanged
    assert source.load("mine", "1").manifest.name == "mine"
    repository = tmp_path / "repo"
    export_tiny(repository / "mine" / "1")
    export_tiny(repository / "mine" / "2", version="2")
    export_tiny(repository / "other" / "1", name="other")
    source = DirectorySource(Settings(weights_dir=repository, device="cpu"))
    assert source.models() == ["mine", "other"] and source.versions("mine") == ["1", "2"]
    assert source.size_bytes("mine", "2") == (repository / "mine" / "2" / "model.torchscript.pt").stat().st_size
    shutil.copytree(repository / "mine" / "1", repository / "mine" / "3")  # a version folder copied by hand
    assert [source.unservable("mine", v) for v in ("1", "2")] == [None, None]
    assert source.unservable("mine", "3") == (
        f"{repository / 'mine' / '3'}/manifest.json says mine version 1, but the repository holds it as mine version "
        "3: export it again with --repository, or move it to mine/1")
    empty = DirectorySource(Settings(weights_dir=tmp_path / "empty", device="cpu"))
    assert empty.models() == []
    # Before: "run `make weights` (python -m models.export --default --out <empty>)", which fills weights/ only.
    assert str(empty.missing()) == (
        f"no manifest.json in {tmp_path / 'empty'}: the folder does not exist; check VISIONSERVE_WEIGHTS_DIR, which "
        "names the folder to serve: an export's folder (e.g. runs/NAME/export) or a model repository (`make weights` "
        "exports the bundled default model into weights/, not there)")


def test_a_weights_dir_named_with_a_space_around_it_is_said_so(tmp_path: Path) -> None:
    # Before: VISIONSERVE_WEIGHTS_DIR="weights " was said as a folder that does not exist, the space unseen (a trial)
    (tmp_path / "weights").mkdir()
    spaced = DirectorySource(Settings(weights_dir=f"{tmp_path / 'weights'} ", device="cpu"))
    assert str(spaced.missing()).startswith(
        f"no manifest.json in {tmp_path / 'weights'} : the folder does not exist ('{tmp_path / 'weights'} ', the "
        f"setting's spaces around it kept), but {tmp_path / 'weights'} does: drop the spaces; check ")


def test_a_version_folder_without_a_manifest_is_in_the_index_saying_why_it_is_not_served(tmp_path: Path) -> None:
    # Before: left out without a word (the load call 200, nothing logged, absent from the index: a TorchServe user
    # dropping a model file into a version folder got no hint)
    export_tiny(tmp_path / "mine" / "1")
    (tmp_path / "mine" / "2").mkdir()
    (tmp_path / "mine" / "2" / "model.pt").write_bytes(b"a model file copied in by hand")
    app = create_app(Settings(weights_dir=tmp_path, device="cpu", log_level="warning"))
    try:
        client = app.test_client()
        rows = [(r["version"], r["state"], r.get("reason", "")) for r in client.post("/v2/repository/index").get_json()]
        assert rows == [("1", "READY", ""), ("2", "UNAVAILABLE", NOT_AN_EXPORT)]
        assert NOT_AN_EXPORT.startswith("not an export: the folder holds no manifest.json, so it is never served")
        assert [r["version"] for r in client.post("/v2/repository/index", json={"ready": True}).get_json()] == ["1"]
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_a_version_filed_under_another_name_or_number_is_refused(tmp_path: Path) -> None:
    import shutil

    export_tiny(tmp_path / "mine" / "1")
    shutil.copytree(tmp_path / "mine" / "1", tmp_path / "mine" / "2")  # copied by hand: its manifest says 1
    source = DirectorySource(Settings(weights_dir=tmp_path, device="cpu"))
    with pytest.raises(ModelLoadError, match="says mine version 1, but the repository holds it as mine version 2"):
        source.load("mine", "2")


def test_the_server_loads_every_model_or_the_named_ones_and_says_what_is_missing(tmp_path: Path) -> None:
    export_tiny(tmp_path / "mine" / "1")
    export_tiny(tmp_path / "other" / "1", name="other")
    for models_setting, served in (("", ["mine", "other"]), ("other", ["other"])):
        app = create_app(Settings(weights_dir=tmp_path, models=models_setting, device="cpu", log_level="warning"))
        try:
            assert [m["name"] for m in app.test_client().get("/v1/models").get_json()["models"]] == served
        finally:
            app.extensions[EXTENSION_KEY].shutdown(timeout=10)
    with pytest.raises(NotFound, match="the repository has no model 'nope'; it has: mine, other"):
        create_app(Settings(weights_dir=tmp_path, models="nope", device="cpu", log_level="warning"))


def test_names_from_urls_bodies_and_folders_follow_one_pattern_and_nothing_outside_is_read(tmp_path: Path) -> None:
    from models.export.repository import NAME_PATTERN

    repository = tmp_path / "repo"
    export_tiny(repository / "mine" / "1")
    export_tiny(tmp_path / "1", name="outside")  # a version-like folder beside the repository
    export_tiny(repository / ".hidden" / "1", name=".hidden")  # a folder no name may reach
    app = create_app(Settings(weights_dir=repository, device="cpu", log_level="warning"))
    client = app.test_client()
    try:
        for method, url, body in (("post", "/v2/repository/models/../load", None),
                                  ("post", "/v2/repository/models/.hidden/load", None),
                                  ("get", "/v2/models/../ready", None),
                                  ("post", "/predict?model=..", b"x"),
                                  ("post", "/predict?model=mine&version=..", b"x"),
                                  ("post", "/v1/models/mine/promote", {"version": "../1"}),
                                  ("post", "/v2/repository/models/mine/load",
                                   {"parameters": {"config": {"rollout": {"candidate": "../1"}}}}),
                                  ("post", "/v2/repository/models/mine/load",
                                   {"parameters": {"config": {"default_version": "../../1"}}})):
            answer = getattr(client, method)(url, **({"json": body} if isinstance(body, dict) else {"data": body}))
            assert answer.status_code == 400, (url, answer.get_json())
            text = answer.get_data(as_text=True)
            assert NAME_PATTERN in text and str(tmp_path) not in text, (url, text)
        assert models(repository) == ["mine"] and versions(repository, "..") == []
        assert client.get("/v1/models").get_json()["models"][0]["name"] == "mine"
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_a_model_models_leaves_out_is_listed_as_not_loaded_until_its_load_call(tmp_path: Path) -> None:
    # Before: its versions were "unloaded", as though a call had unloaded them
    export_tiny(tmp_path / "mine" / "1")
    export_tiny(tmp_path / "other" / "1", name="other")
    app = create_app(Settings(weights_dir=tmp_path, models="mine", device="cpu", log_level="warning"))
    client = app.test_client()
    try:
        rows = {row["name"]: (row["state"], row.get("reason")) for row in client.post("/v2/repository/index").json}
        assert rows == {"mine": ("READY", ""), "other": ("UNAVAILABLE", "not loaded (its load call loads it)")}
        assert client.post("/v2/repository/models/other/load").status_code == 200
        # each model's default version is its default, in the index as in /v1/models (before: in the index only the
        # server's default model's, so other's 1 said false in one and true in the other)
        index = {row["name"]: row["default"] for row in client.post("/v2/repository/index").json}
        listed = {row["name"]: row["default"] for row in client.get("/v1/models").json["models"]}
        assert index == listed == {"mine": True, "other": True}
        assert client.post("/v2/repository/models/other/unload").status_code == 200
        rows = {row["name"]: (row["state"], row.get("reason")) for row in client.post("/v2/repository/index").json}
        assert rows["other"] == ("UNAVAILABLE", "unloaded")
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_a_policy_json_that_is_not_json_keeps_its_model_out_and_the_index_and_the_404_say_why(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    # Before: the index listed mine 1 as UNAVAILABLE "unloaded", the 404 of a request for the default model did
    # not say why it was not loaded, and every poll logged the policy's error again.
    export_tiny(tmp_path / "mine" / "1")
    export_tiny(tmp_path / "other" / "1", name="other")
    policy = tmp_path / "mine" / "policy.json"
    policy.write_text("{nope", encoding="utf-8")
    (tmp_path / "repository.json").write_text('{"default_model": "mine"}', encoding="utf-8")
    not_json = f"model 'mine': {policy} is not JSON: Expecting property name enclosed in double quotes"

    def said(words: str) -> int:
        return sum(words in record.getMessage() for record in caplog.records)

    with caplog.at_level(logging.WARNING, logger="app.engine.versions.writers"):
        app = create_app(Settings(weights_dir=tmp_path, device="cpu", log_level="warning"))
        client, writers = app.test_client(), app.extensions[EXTENSION_KEY].controller.writers
        try:
            (row, _) = client.post("/v2/repository/index").get_json()
            assert (row["name"], row["state"]) == ("mine", "UNAVAILABLE") and row["reason"].startswith(not_json)
            answer = client.post("/predict", data=b"x", content_type="image/jpeg")
            assert answer.status_code == 404 and answer.get_json()["error"]["message"].startswith(
                f"no model 'mine' (the default model) is loaded: {not_json}")
            for _ in range(3):
                writers.poll()
            assert said(not_json) == 1  # at start, not again by each poll
            policy.write_text("[]", encoding="utf-8")  # broken another way: said once more
            for _ in range(3):
                writers.poll()
            assert said(not_json) == 1 and said(f"{policy} must hold a JSON object") == 1
            policy.write_text('{"version_policy": {"all": {}}}', encoding="utf-8")  # fixed: the poll serves it
            writers.poll()
            assert client.post("/v2/repository/index").get_json()[0]["state"] == "READY"
            assert client.get("/v1/models").get_json()["default_model"] == "mine"
        finally:
            app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_a_name_ending_in_a_newline_is_outside_the_pattern(settings: Settings, tmp_path: Path) -> None:
    # Before: "^...$" with re.match also matched before a final newline: "colour\n" passed the name check (a 404
    # from the lookup, not the documented 400), "1\n" counted as a numbered version, and so did a folder so named.
    from app.engine.rollouts.policy import PolicyError, VersionPolicy
    from models.export.repository import InvalidName, check_name, version_order

    for kind, value in (("model", "colour\n"), ("version", "1\n")):
        with pytest.raises(InvalidName):
            check_name(kind, value)
    assert version_order("1\n") == (1, 0, "1\n") and VersionPolicy().default_of(["1\n", "2", "10\n"]) == "2"
    for name in ("mine", "mine\n"):
        (tmp_path / "repo" / name / "1").mkdir(parents=True)
        (tmp_path / "repo" / name / "1" / "manifest.json").write_text("{}", encoding="utf-8")
    assert models(tmp_path / "repo") == ["mine"] and versions(tmp_path / "repo", "mine\n") == []
    # str.isdigit takes "²", which int() refused with a ValueError (a 500), not a PolicyError
    with pytest.raises(PolicyError, match="num_versions must be a whole number"):
        VersionPolicy.from_config({"version_policy": {"latest": {"num_versions": "²"}}}, VersionPolicy())
    repository = FakeRepository()
    repository.add("colour", "1")
    app = create_app(settings, source=repository)  # type: ignore[arg-type]
    client = app.test_client()
    try:
        for url, body in (("/v2/repository/models/colour%0A/load", {}),
                          ("/v2/repository/models/colour/load", {"parameters": {"config": {"default_version": "1\n"}}}),
                          ("/v2/models/colour/versions/1%0A/infer", {"inputs": []})):
            answer = client.post(url, json=body)
            assert answer.status_code == 400 and "names match" in answer.get_data(as_text=True), (url, answer.json)
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_a_single_export_whose_manifest_turns_invalid_serves_on_and_says_why(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import json
    import logging

    # Before: every poll round raised the manifest's ModelLoadError (skipping the round's follow and evidence
    # sharing), and POST /v2/repository/index answered 500.
    weights = export_tiny(tmp_path / "weights")
    good = (weights / "manifest.json").read_text(encoding="utf-8")

    def write_manifest(text: str) -> None:
        (weights / "manifest.json.tmp").write_text(text, encoding="utf-8")
        (weights / "manifest.json.tmp").replace(weights / "manifest.json")

    app = create_app(Settings(weights_dir=weights, device="cpu", log_level="warning"))
    client, writers = app.test_client(), app.extensions[EXTENSION_KEY].controller.writers
    try:
        write_manifest(json.dumps({**json.loads(good), "labels": ["a"]}))  # one label: does not validate
        with caplog.at_level(logging.WARNING, logger="app.engine.versions.writers"):
            for _ in range(3):
                writers.poll()
        assert sum("manifest.json is invalid" in r.getMessage() for r in caplog.records) == 1  # once, not per poll
        index = client.post("/v2/repository/index")
        assert index.status_code == 200
        assert [(r["name"], r["version"], r["state"]) for r in index.get_json()] == [("mine", "1", "READY")]
        (worker,) = client.get("/v1/models").get_json()["workers"]
        assert f"model 'mine': {weights}/manifest.json is invalid" in worker["error"]
        answer = client.post("/v2/repository/models/mine/load")  # nothing changes while it stands
        assert answer.status_code == 400 and "manifest.json is invalid" in answer.get_json()["error"]
        write_manifest(good)  # fixed: served as before, and no longer said
        writers.poll()
        assert client.get("/v1/models").get_json()["workers"][0]["error"] is None
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)

def test_specific_versions_that_are_no_list_are_400_saying_so(settings: Settings) -> None:
    # Before: a string was read a character a version: "abc" asked for versions a, b and c ("no version a, b, c").
    repository = FakeRepository()
    repository.add("colour", "1")
    app = create_app(settings, source=repository)  # type: ignore[arg-type]
    try:
        for versions in ("abc", "1", {"1": True}):
            answer = app.test_client().post("/v2/repository/models/colour/load", json={"parameters": {"config": {
                "version_policy": {"specific": {"versions": versions}}}}})
            assert answer.status_code == 400, (versions, answer.json)
            assert "specific's versions must be a list of versions" in answer.json["error"]
        answer = app.test_client().post("/v2/repository/models/colour/load", json={"parameters": {"config": {
            "version_policy": {"specific": {"versions": [1]}}}}})  # Triton's configs write versions as numbers
        assert answer.status_code == 200, answer.json
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)
