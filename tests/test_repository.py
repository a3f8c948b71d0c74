"""The model repository (#20, first part): <repository>/<model>/<version>/, written by models.export --repository,
served by pointing VISIONSERVE_WEIGHTS_DIR at it (MODEL_NAME / MODEL_VERSION choose; the newest by default)."""
from __future__ import annotations

from pathlib import Path

import pytest

from app.engine.weights import ModelLoadError, served_dir
from models.repository import RepositoryError, models, newest, next_version, resolve, versions
from tests.fakes import export_tiny


def test_versions_are_ordered_by_number_and_the_next_one_counts_on(tmp_path: Path) -> None:
    for version in ("1", "2", "10", "canary"):
        export_tiny(tmp_path / "mine" / version, version=version)
    (tmp_path / "mine" / "11").mkdir()  # no manifest: not a version
    assert versions(tmp_path, "mine") == ["1", "2", "10", "canary"]
    assert newest(tmp_path, "mine") == "10" and next_version(tmp_path, "mine") == "11"
    assert next_version(tmp_path, "other") == "1" and models(tmp_path) == ["mine"]


def test_resolve_serves_a_single_export_or_the_chosen_version(tmp_path: Path) -> None:
    single = export_tiny(tmp_path / "weights")
    assert resolve(single) == single  # today's weights/ works unchanged
    repository = tmp_path / "repo"
    export_tiny(repository / "mine" / "1")
    export_tiny(repository / "mine" / "2", version="2")
    assert resolve(repository) == repository / "mine" / "2"
    assert resolve(repository, version="1") == repository / "mine" / "1"
    with pytest.raises(RepositoryError, match="no version '7' of 'mine'; it has: 1, 2"):
        resolve(repository, version="7")
    export_tiny(repository / "other" / "1", name="other")
    with pytest.raises(RepositoryError, match="holds 2 models \\(mine, other\\): set VISIONSERVE_MODEL_NAME"):
        resolve(repository)
    with pytest.raises(RepositoryError, match="no model 'nope'; it has: mine, other"):
        resolve(repository, "nope")
    with pytest.raises(ModelLoadError, match="holds 2 models"):  # a one-line boot error in the server
        served_dir(repository, None, None)
    assert served_dir(tmp_path / "empty", None, None) == tmp_path / "empty"  # "run make weights" comes next
