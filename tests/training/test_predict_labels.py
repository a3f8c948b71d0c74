"""models.predict --labels that names none of the inputs: one line saying how paths are matched, before the model
loads, instead of a metrics file of nothing and a crash in the confusion matrix."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from harness.photos import jpeg, photo
from models.export.manifest import TrainedOn
from models.predict.__main__ import main
from models.predict.evaluate import check_labels, trained_count
from models.run.args import DataError
from models.run.report import write_held_out
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


@pytest.mark.slow  # seconds: an export and two evaluations (the fast subset stays under a minute)
def test_an_evaluation_on_images_the_model_trained_on_says_how_many_and_how_to_evaluate_on_those_held_out(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Before: a run's own folder evaluated whole (most of it trained on) printed its accuracy as any other.
    weights = export_tiny(tmp_path / "weights")
    data = tmp_path / "my data"  # a folder a run split (--val-split): one image of each class held out
    for name in ("a", "b", "c"):
        (data / name).mkdir(parents=True)
        for i in range(2):
            (data / name / f"{i}.jpg").write_bytes(jpeg(photo("astronaut"), size=(48, 48)))
    run = tmp_path / "runs" / "mine"
    run.mkdir(parents=True)
    held = write_held_out(run, [data / name / "0.jpg" for name in ("a", "b", "c")])
    manifest = json.loads((weights / "manifest.json").read_text())
    manifest["trained_on"] = {"folder": str(data), "held_out": str(held)}  # as models.export writes a run's
    (weights / "manifest.json").write_text(json.dumps(manifest))

    def evaluate(scored: Path, out: str) -> tuple[list[str], dict]:
        caplog.clear()
        with caplog.at_level(logging.INFO):
            assert main(["--weights", str(weights), "--data", str(scored), "--labels", str(data), "--out",
                         str(tmp_path / f"{out}.jsonl"), "--workers", "0"]) == 0
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        return said, json.loads((tmp_path / f"{out}-report" / "metrics.json").read_text())

    said, metrics = evaluate(data, "whole")
    expected = (f"3 of the 6 labelled images are ones mine 1 trained on (under {data} and not in {held}): its "
                f"accuracy on them overstates how it does on images it has not seen; evaluate on those its run held "
                f"out: --data {held} --labels '{data}'")  # as a shell reads it: the name has a space
    before = expected.replace("labelled images", "labelled files (not yet read)")  # (one may be no image)
    assert said == [before, expected] and metrics["trained_on"] == 3  # before scoring, and again at the end
    said, metrics = evaluate(held, "held")  # the command it names: none of them trained on, nothing said
    assert said == [] and metrics["trained_on"] == 0 and metrics["count"] == 3
    manifest["trained_on"] = {"folder": str(tmp_path / "elsewhere"), "held_out": None}  # trained on another machine
    (weights / "manifest.json").write_text(json.dumps(manifest))
    said, metrics = evaluate(data, "moved")
    assert said == [] and metrics["trained_on"] is None  # cannot tell: says nothing, counts nothing


def test_the_images_trained_on_are_counted_as_paths_under_the_folder_not_held_out(tmp_path: Path) -> None:
    held = tmp_path / "run" / "held_out.txt"
    held.parent.mkdir()
    held.write_text("# held out\n../data/a/0.jpg\n\n")
    (tmp_path / "data" / "a").mkdir(parents=True)
    trained = TrainedOn(folder=str(tmp_path / "data"), held_out=str(held))
    files = [str(tmp_path / "data" / "a" / "0.jpg"), str(tmp_path / "data" / "a" / "1.jpg"),
             str(tmp_path / "data" / "a" / ".." / "a" / "2.jpg"), str(tmp_path / "data-2" / "a" / "3.jpg")]
    assert trained_count(trained, files) == 2  # 1.jpg and 2.jpg; data-2 is another folder
    assert trained_count(TrainedOn(folder=str(tmp_path / "data")), files) == 3  # a train/ folder: all under it
    assert trained_count(None, files) is None
    assert trained_count(TrainedOn(folder=str(tmp_path / "data"), held_out=str(tmp_path / "gone.txt")), files) is None
    # a folder linked to the training folder is it (before: its images counted 0 trained on)
    (tmp_path / "link").symlink_to(tmp_path / "data")
    linked = [str(tmp_path / "link" / "a" / name) for name in ("0.jpg", "1.jpg", "2.jpg")]
    assert trained_count(trained, linked) == 2


def test_images_of_a_linked_class_folder_or_linked_files_count_as_trained_on(tmp_path: Path) -> None:
    # Before: compared with the training folder's own real path only, so the images of a class folder linked from
    # elsewhere (which training reads), and linked files, counted as never seen: "top-1 1.0000" on trained images,
    # with no warning (a data scientist's trial).
    elsewhere, data = tmp_path / "elsewhere", tmp_path / "data"
    for folder in (elsewhere / "astronaut", elsewhere / "rocket", data / "coffee", data / "rocket"):
        folder.mkdir(parents=True)
    for name in ("0.jpg", "1.jpg", "2.jpg"):
        (elsewhere / "astronaut" / name).write_bytes(b"x")
        (elsewhere / "rocket" / name).write_bytes(b"x")
        (data / "rocket" / name).symlink_to(elsewhere / "rocket" / name)  # linked files
    (data / "astronaut").symlink_to(elsewhere / "astronaut")  # a linked class folder
    (data / "coffee" / "0.jpg").write_bytes(b"x")
    held = tmp_path / "held_out.txt"
    held.write_text(f"{data / 'astronaut' / '0.jpg'}\n{data / 'rocket' / '0.jpg'}\n")
    trained = TrainedOn(folder=str(data), held_out=str(held))
    astronauts = [str(elsewhere / "astronaut" / name) for name in ("0.jpg", "1.jpg", "2.jpg")]  # where they lie
    assert trained_count(trained, astronauts) == 2  # 0.jpg held out
    assert trained_count(trained, [str(data / "astronaut" / "1.jpg")]) == 1  # as training read it
    assert trained_count(trained, [str(elsewhere / "rocket" / n) for n in ("0.jpg", "1.jpg", "2.jpg")]) == 2
    assert trained_count(trained, [str(data / "coffee" / "0.jpg"), str(elsewhere / "stray.jpg")]) == 1


def test_a_manifest_without_trained_on_is_written_without_the_field(tmp_path: Path) -> None:
    # Before: "trained_on": null, which a server from before the field refuses (its manifest forbids unknown keys):
    # an export of no run made by this release could not be rolled out to one.
    from models.export.manifest import read_manifest, write_manifest
    from tests.support.fakes import tiny_manifest

    manifest = tiny_manifest()
    write_manifest(tmp_path, manifest)
    assert "trained_on" not in json.loads((tmp_path / "manifest.json").read_text())
    trained = manifest.model_copy(update={"trained_on": TrainedOn(folder=str(tmp_path / "data"))})
    write_manifest(tmp_path, trained)
    assert read_manifest(tmp_path).trained_on == trained.trained_on


def test_labels_naming_a_class_in_another_unicode_form_say_so() -> None:
    # Before: "--labels names classes the model does not have: café", the model's own "café" written composed
    # (a label folder copied from macOS holds it decomposed): the two read alike (a messy-data trial)
    composed, decomposed = "caf\u00e9", "cafe\u0301"
    with pytest.raises(DataError, match="another Unicode form than the model's") as raised:
        check_labels({"a.jpg": decomposed, "b.jpg": "tea"}, [composed, "tea"])
    assert repr(composed) in str(raised.value) and repr(decomposed) in str(raised.value)
    with pytest.raises(DataError, match="does not have: juice"):  # a class truly missing is said as before
        check_labels({"a.jpg": "juice"}, [composed, "tea"])
    check_labels({"a.jpg": composed}, [composed, "tea"])  # the same form: known
