"""models.predict --labels that names none of the inputs: one line saying how paths are matched, before the model
loads, instead of a metrics file of nothing and a crash in the confusion matrix."""
from __future__ import annotations

from pathlib import Path

import pytest

from harness.photos import jpeg, photo
from models.predict.__main__ import main
from tests.support.fakes import export_tiny


@pytest.fixture
def scored(tmp_path: Path) -> tuple[Path, Path]:
    weights = export_tiny(tmp_path / "weights")
    photos = tmp_path / "photos"
    for name in ("a", "b"):
        (photos / "cats").mkdir(parents=True, exist_ok=True)
        (photos / "cats" / f"{name}.jpg").write_bytes(jpeg(photo("astronaut"), size=(64, 64)))
    return weights, photos


def test_a_csv_whose_paths_name_no_input_says_how_paths_are_read(scored: tuple[Path, Path], tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    weights, photos = scored
    table = tmp_path / "labels" / "labels.csv"
    table.parent.mkdir()
    table.write_text("path,label\nphotos/cats/a.jpg,a\nphotos/cats/b.jpg,b\n")  # relative to the CSV: ../photos
    out = tmp_path / "scores.jsonl"
    assert main(["--weights", str(weights), "--data", str(photos), "--out", str(out), "--labels", str(table)]) == 2
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(said) == 1 and "none of the 2 inputs has a label" in said[0] and "\n" not in said[0], said
    assert f"relative to the CSV's own folder {table.parent.resolve()}" in said[0]
    assert str(tmp_path / "labels" / "photos" / "cats" / "a.jpg") in said[0] and not out.exists()


def test_a_folder_of_labels_no_input_lies_under_says_so(scored: tuple[Path, Path], tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    weights, photos = scored
    (tmp_path / "elsewhere" / "a").mkdir(parents=True)
    assert main(["--weights", str(weights), "--data", str(photos), "--out", str(tmp_path / "s.jsonl"),
                 "--labels", str(tmp_path / "elsewhere")]) == 2
    said = caplog.text
    assert "none of the 2 inputs has a label: each input's label is its first folder under" in said
