"""python -m models.predict on the inputs and options a batch scorer meets at its edges: file names that are not
UTF-8, lists and label tables that are not, named pipes in a folder or a list, numbers out of range, an --out it
does not write, the --help examples as printed, and a run in which every input failed."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import shutil
import sys
import threading
import types
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from harness.photos import jpeg, photo
from models.export.checks import read_checked_manifest
from models.neighbours import main as neighbours
from models.predict import __main__ as predict
from models.predict.__main__ import main
from models.predict.outputs import check_parquet_names, names_file, read_names
from tests.support.answers import predict_error
from tests.support.fakes import export_tiny

BAD_NAME = b"bad-\xff-name.jpg"  # a Latin-1 name on a UTF-8 system: os.walk gives it as "bad-\udcff-name.jpg"


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """export_tiny's classes a, b, c (an untrained head: every photo's top-1 is a)."""
    return export_tiny(tmp_path_factory.mktemp("tiny") / "export")


@pytest.fixture(scope="module")
def picture() -> bytes:
    return jpeg(photo("astronaut"), size=(64, 48))


@pytest.fixture
def no_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model may not load: what the test refuses must be refused before."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the mistake was named")

    monkeypatch.setattr(predict, "load_model", refuse)


def _run(weights: Path, data: Path, out: Path, *more: str) -> int:
    return main(["--weights", str(weights), "--data", str(data), "--out", str(out), "--workers", "0", *more])


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _with_bad_name(folder: Path, picture: bytes) -> str:
    """``folder`` holding ok.jpg and a photo whose name is not UTF-8; returns that one's path as os.walk gives it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ok.jpg").write_bytes(picture)
    bad = os.path.join(os.fsencode(folder), BAD_NAME)
    with open(bad, "wb") as handle:
        handle.write(picture)
    return os.fsdecode(bad)


@pytest.mark.slow  # a second or more (a run of the CLI, make, or workers sharing a state): the full suite's
def test_a_file_name_that_is_not_utf8_is_scored_and_written_losslessly(weights: Path, picture: bytes, tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    # Before: UnicodeEncodeError writing its record: the batch was lost, and every rerun failed the same way.
    data = tmp_path / "photos"
    bad = _with_bad_name(data, picture)
    out, embeddings = tmp_path / "scores.jsonl", tmp_path / "photos.npy"
    assert _run(weights, data, out, "--embeddings", str(embeddings)) == 0
    records = _lines(out)  # the file is UTF-8 (the name in a JSON escape), and reads back to the same path
    assert [r["path"] for r in records] == [bad, str(data / "ok.jpg")]
    assert "\\udcff" in out.read_text(encoding="ascii") and all("error" not in r for r in records)
    assert open(records[0]["path"], "rb").read() == picture  # the name written opens the file scored
    listed = names_file(embeddings).read_bytes().splitlines()  # the names file: the name's own bytes
    assert listed == [os.fsencode(bad), os.fsencode(data / "ok.jpg")]
    csv_out = tmp_path / "scores.csv"
    assert _run(weights, data, csv_out) == 0
    assert os.path.join(os.fsencode(data), BAD_NAME) in csv_out.read_bytes()  # as the file system has it
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="models.predict"):  # reruns read them back: nothing left to score
        assert _run(weights, data, out, "--embeddings", str(embeddings)) == 0
        assert _run(weights, data, csv_out) == 0
    said = [r.getMessage() for r in caplog.records if "inputs (" in r.getMessage()]
    assert len(said) == 2 and all("on 0 of 2 inputs (2 written before)" in line for line in said), said


# Characters str.splitlines() ends a line at, besides "\n" and "\r" (which --embeddings refuses in a name).
SPLITLINES_ENDS = ("\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e")


@pytest.mark.slow  # scoring runs of seconds each
def test_names_holding_what_splitlines_splits_at_are_written_kept_and_read_back(
        weights: Path, picture: bytes, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Before: a record whose path held U+2028, U+2029 or U+0085 was written raw and read back as two halves, neither
    # JSON: dropped, so every rerun scored it again; the names file, read with splitlines(), held more lines than the
    # .npy rows: a rerun scored every image again and models.neighbours refused the file (exit 2).
    data = tmp_path / "photos"
    data.mkdir()
    names = ["plain.jpg", *(f"x{end}y.jpg" for end in SPLITLINES_ENDS)]
    for name in names:
        (data / name).write_bytes(picture)
    out, embeddings = tmp_path / "scores.jsonl", tmp_path / "photos.npy"
    assert _run(weights, data, out, "--embeddings", str(embeddings)) == 0
    paths = sorted(str(data / name) for name in names)
    lines = out.read_text(encoding="utf-8").splitlines()  # as most readers split it: one record a line
    assert [json.loads(line)["path"] for line in lines] == paths
    assert read_names(names_file(embeddings)) == paths and np.load(embeddings).shape[0] == len(paths)
    older = out.read_text(encoding="utf-8")  # as runs before the fix wrote it: those characters raw
    for end in SPLITLINES_ENDS[:3]:
        older = older.replace(f"\\u{ord(end):04x}", end)
    out.write_text(older, encoding="utf-8")
    assert len(older.splitlines()) > len(paths)  # what splitlines() cut in two
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="models.predict"):
        assert _run(weights, data, out, "--embeddings", str(embeddings)) == 0
    assert f"on 0 of {len(paths)} inputs ({len(paths)} written before)" in caplog.text  # each record and row kept
    assert neighbours([str(embeddings), "--duplicates"]) == 0  # one name a row: the same photo, every pair


@pytest.mark.slow  # a second or more (a run of the CLI, make, or workers sharing a state): the full suite's
def test_a_mistake_whose_name_is_not_utf8_is_shown_on_the_page(weights: Path, picture: bytes, tmp_path: Path) -> None:
    data = tmp_path / "labelled"
    (data / "a").mkdir(parents=True)
    (data / "a" / "right.jpg").write_bytes(picture)
    _with_bad_name(data / "b", picture)  # true class b, answered a: two mistakes, one named in Latin-1
    assert _run(weights, data, tmp_path / "eval.jsonl", "--labels", str(data)) == 0
    page = (tmp_path / "eval-report" / "mistakes.html").read_text(encoding="utf-8")
    assert "bad-\ufffd-name.jpg" in page and page.count("<figure>") == 2


def test_parquet_refuses_a_name_that_is_not_utf8_before_the_model_loads(weights: Path, picture: bytes,
                                                                       tmp_path: Path, no_load: None,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    # Parquet's strings are UTF-8: no lossless form for such a name, so the run stops before it loads anything.
    data = tmp_path / "photos"
    _with_bad_name(data, picture)
    monkeypatch.setitem(sys.modules, "pyarrow", types.ModuleType("pyarrow"))  # as if installed: the check after it
    out = tmp_path / "scores.parquet"
    line = predict_error(["--weights", str(weights), "--data", str(data), "--out", str(out)], caplog)
    assert line == (f"error: --out {out}: the input {data}/bad-\\xff-name.jpg has a name that is not UTF-8, which "
                    "Parquet cannot hold: write .jsonl or .csv (they keep it), or rename the file")
    check_parquet_names([str(data / "ok.jpg")], out)  # UTF-8 names pass


def test_a_list_or_a_labels_csv_that_is_not_utf8_is_one_line_naming_its_line(weights: Path, picture: bytes,
                                                                              tmp_path: Path, no_load: None,
                                                                              caplog: pytest.LogCaptureFixture) -> None:
    # Before: a UnicodeDecodeError traceback, exit 1.
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "one.jpg").write_bytes(picture)
    listed = tmp_path / "list.txt"
    listed.write_bytes(b"a/one.jpg\n# caf\xe9, in Latin-1\n")
    out = str(tmp_path / "s.jsonl")
    assert predict_error(["--weights", str(weights), "--data", str(listed), "--out", out], caplog) == (
        f"error: --data {listed}: line 2 is not UTF-8 text (byte 0xe9): save it as UTF-8")
    table = tmp_path / "labels.csv"
    table.write_bytes(b"path,label\na/one.jpg,a\na/caf\xe9.jpg,a\n")
    assert predict_error(["--weights", str(weights), "--data", str(tmp_path / "a"), "--out", out,
                          "--labels", str(table)], caplog) == (
        f"error: --labels {table}: line 3 is not UTF-8 text (byte 0xe9): save it as UTF-8")


@pytest.mark.parametrize("option, value, message", [
    ("--top-k", "-1", "argument --top-k: must be at least 1, got -1"),
    ("--top-k", "0", "argument --top-k: must be at least 1, got 0"),
    ("--workers", "-1", "argument --workers: must be at least 0, got -1"),
    ("--batch-size", "-1", "argument --batch-size: must be at least 0, got -1"),
    ("--mistakes", "-1", "argument --mistakes: must be at least 0, got -1"),
    ("--threads", "-2", "argument --threads: must be at least 0, got -2"),
    ("--top-k", "two", "argument --top-k: 'two' is not a whole number"),
])
def test_numbers_out_of_range_stop_the_command_before_the_model_loads(weights: Path, tmp_path: Path, no_load: None,
                                                                      capsys: pytest.CaptureFixture[str],
                                                                      option: str, value: str, message: str) -> None:
    # Before: --top-k -1, --workers -1 and --top-k 0 with --labels crashed after the model loaded; --batch-size -1
    # scored nothing and exited 0.
    with pytest.raises(SystemExit) as stopped:
        main(["--weights", str(weights), "--data", str(tmp_path), "--out", str(tmp_path / "s.jsonl"), option, value])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"python -m models.predict: error: {message}")


def test_a_top_k_above_the_model_s_classes_stops_the_command_before_the_model_loads(
        weights: Path, picture: bytes, tmp_path: Path, no_load: None, caplog: pytest.LogCaptureFixture) -> None:
    # Before: --top-k 11 on a model of 10 classes wrote 10 answers an image, where /predict?top_k=11 is 400.
    (tmp_path / "one.jpg").write_bytes(picture)
    manifest = read_checked_manifest(weights)
    classes = manifest.num_classes
    assert predict_error(["--weights", str(weights), "--data", str(tmp_path / "one.jpg"), "--out",
                          str(tmp_path / "s.jsonl"), "--top-k", str(classes + 1)], caplog) == (
        f"error: --top-k {classes + 1}: {manifest.name} {manifest.version} has {classes} classes, so at most "
        f"{classes} answers an image")
    assert predict.top_k(classes, manifest) == classes and predict.top_k(None, manifest) == min(5, classes)
    fewer = manifest.model_copy(update={"labels": manifest.labels[:3]})
    assert predict.top_k(None, fewer) == 3  # the default: 5, or the model's classes if fewer


def test_the_bounds_themselves_are_taken() -> None:
    args = predict.get_args_parser().parse_args(["--weights", "w", "--data", "d", "--out", "o.jsonl", "--top-k", "1",
                                                 "--workers", "0", "--batch-size", "0", "--mistakes", "0"])
    assert (args.top_k, args.workers, args.batch_size, args.mistakes) == (1, 0, 0, 0)


def _training_layout(root: Path, picture: bytes) -> Path:
    """data/mine as training lays it out: train/ and val/, each of <class>/ folders."""
    for split in ("train", "val"):
        for label in ("a", "b"):
            (root / split / label).mkdir(parents=True)
            (root / split / label / "one.jpg").write_bytes(picture)
    return root


@pytest.mark.slow  # a second or more (a run of the CLI, make, or workers sharing a state): the full suite's
def test_the_help_examples_run_as_printed(weights: Path, picture: bytes, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Before: the evaluation example said --data data/mine --labels data/mine, which the tool itself refuses on the
    # layout docs/training.md gives data/mine (train/ and val/).
    (tmp_path / "runs" / "mine").mkdir(parents=True)
    shutil.copytree(weights, tmp_path / "runs" / "mine" / "export")
    shutil.copytree(weights, tmp_path / "weights")
    _training_layout(tmp_path / "data" / "mine", picture)
    shutil.copytree(tmp_path / "data" / "mine" / "val", tmp_path / "photos")
    export_tiny(tmp_path / "repository" / "mine" / "2", version="2")
    (tmp_path / "list.txt").write_text("photos/a/one.jpg\n")
    monkeypatch.chdir(tmp_path)
    examples = [shlex.split(line.split("#", 1)[0]) for line in predict.__doc__.replace("\\\n", " ").splitlines()
                if line.strip().startswith(".venv/bin/python -m models.predict")]
    assert len(examples) == 4
    for words in examples:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="models.predict"):
            assert main([*words[3:], "--workers", "0"]) == 0, (words, caplog.text)
        if "--labels" in words:
            assert "evaluated 2 images: top-1" in caplog.text  # val/a and val/b, not train/


@contextlib.contextmanager
def _unblocked(fifo: Path) -> Iterator[None]:
    """While open, whoever opens ``fifo`` to read finds a writer that leaves at once: a regression then reads an
    empty file instead of waiting forever for one, and its test fails rather than hangs."""
    done = threading.Event()

    def writer() -> None:
        while not done.wait(0.05):
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # ENXIO while nobody reads
            except OSError:
                pass

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


@pytest.mark.slow  # a second or more (a run of the CLI, make, or workers sharing a state): the full suite's
def test_a_named_pipe_is_left_out_of_a_folder_and_is_an_error_record_in_a_list(weights: Path, picture: bytes,
                                                                               tmp_path: Path) -> None:
    # Before: the run waited forever to read the pipe.
    data = tmp_path / "photos"
    data.mkdir()
    (data / "a.jpg").write_bytes(picture)
    os.mkfifo(data / "pipe")
    os.symlink(data / "gone.jpg", data / "link.jpg")  # leads nowhere: kept, its record says why
    listed = tmp_path / "list.txt"
    listed.write_text("photos/a.jpg\nphotos/pipe\nphotos\n")
    with _unblocked(data / "pipe"):
        assert _run(weights, data, tmp_path / "folder.jsonl") == 0
        assert _run(weights, listed, tmp_path / "list.jsonl") == 0
    folder = _lines(tmp_path / "folder.jsonl")
    assert [Path(r["path"]).name for r in folder] == ["a.jpg", "link.jpg"]
    assert folder[1]["error"] == "cannot read the file: No such file or directory"
    by_path = {r["path"]: r for r in _lines(tmp_path / "list.jsonl")}
    assert "labels" in by_path["photos/a.jpg"]
    assert by_path["photos/pipe"]["error"] == "cannot read the file: it is a named pipe, not a regular file"
    assert by_path["photos"]["error"] == "cannot read the file: it is a folder, not a regular file"


@pytest.mark.parametrize("name", ["scores.json", "scores.txt"])
def test_an_out_the_tool_does_not_write_is_refused_before_the_model_loads(weights: Path, tmp_path: Path, no_load: None,
                                                                          caplog: pytest.LogCaptureFixture,
                                                                          name: str) -> None:
    # Before: --out x.json was written as JSON Lines, which a JSON reader cannot read.
    out = tmp_path / name
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jpg").write_bytes(b"")
    line = predict_error(["--weights", str(weights), "--data", str(tmp_path / "data"), "--out", str(out)], caplog)
    assert line.startswith(f"error: --out {out}: write .jsonl, .csv or .parquet (JSON Lines also as .ndjson)")
    assert ("a .json file is one JSON document" in line) == name.endswith(".json") and not out.exists()


@pytest.mark.slow  # a second or more (a run of the CLI, make, or workers sharing a state): the full suite's
def test_a_run_in_which_every_input_failed_exits_1_with_one_line(weights: Path, picture: bytes, tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    # Before: it exited 0, as if the folder had been scored.
    data = tmp_path / "data"
    data.mkdir()
    (data / "notes.txt").write_text("not an image")
    (data / "truncated.jpg").write_bytes(picture[:300])
    out = tmp_path / "scores.jsonl"
    with caplog.at_level(logging.INFO, logger="models.predict"):
        assert _run(weights, data, out) == 1
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert line.startswith(f"error: none of the 2 inputs could be scored: each has its reason in {out} (the first, "
                           f"{data / 'notes.txt'}: ") and "\n" not in line
    assert [bool(r.get("error")) for r in _lines(out)] == [True, True]  # the reasons are written all the same
    (data / "good.jpg").write_bytes(picture)
    assert _run(weights, data, out) == 0  # one scored: a run that did its work


@pytest.mark.slow  # scoring runs of seconds each
def test_a_run_s_own_names_file_is_a_list_another_run_reads_name_for_name(weights: Path, picture: bytes,
                                                                           tmp_path: Path) -> None:
    # Before: a list was split with splitlines() and each line stripped of any white space: names holding U+2028, a
    # form feed or U+0085 became two missing files, one ending in a no-break space another missing one.
    data = tmp_path / "photos"
    data.mkdir()
    for name in ("a\u2028b.jpg", "form\x0cfeed.jpg", "x\x85y.jpg", "nbsp\u00a0end.jpg\u00a0", "plain.jpg"):
        (data / name).write_bytes(picture)
    embeddings = tmp_path / "first.npy"
    assert _run(weights, data, tmp_path / "first.jsonl", "--embeddings", str(embeddings)) == 0
    listed = tmp_path / "again.txt"
    shutil.copy(names_file(embeddings), listed)  # the names this command wrote, as the list of the next run
    lines = [f"  {line}\r" if line.endswith("plain.jpg") else line
             for line in listed.read_text(encoding="utf-8").split("\n")]
    listed.write_text("\n".join(lines), encoding="utf-8")
    assert _run(weights, listed, tmp_path / "again.jsonl") == 0
    again = _lines(tmp_path / "again.jsonl")
    assert len(again) == 5 and not [line for line in again if "error" in line]  # ASCII space and CR taken off


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_a_second_run_on_an_output_another_run_writes_is_refused(weights: Path, picture: bytes, tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    # Before: both ran, each appending to the same parts and numbering embedding rows from its own count: most
    # images got another's embedding, and both said they wrote them all.
    from models.predict.outputs import hold_output

    data = tmp_path / "photos"
    data.mkdir()
    (data / "one.jpg").write_bytes(picture)
    out = tmp_path / "scores.jsonl"
    held = hold_output(out)  # the first run, still writing
    try:
        with caplog.at_level(logging.ERROR, logger="models.predict"):
            assert _run(weights, data, out, "--embeddings", str(tmp_path / "e.npy")) == 2
        assert f"another run writes {out} now (pid {os.getpid()})" in caplog.text
        assert not out.exists() and not (tmp_path / "e.npy").exists()
    finally:
        held.close()
    assert _run(weights, data, out) == 0 and len(_lines(out)) == 1  # once it ended
    assert not list(tmp_path.glob(".scores.jsonl.lock"))  # no lock file left beside the output
    assert _run(weights, data, out, "--top-k", "2") == 2  # nor after a run refused once it held the output
    assert not list(tmp_path.glob(".scores.jsonl.lock"))


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_a_resume_with_another_top_k_or_precision_is_refused(weights: Path, picture: bytes, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    # Before: a run stopped with --top-k 3 and resumed with --top-k 2 (or another format, dtype or decode path)
    # wrote one file of two configurations' answers, no row saying which.
    data = tmp_path / "photos"
    data.mkdir()
    for i in range(3):
        (data / f"{i}.jpg").write_bytes(picture)
    whole = tmp_path / "whole.jsonl"
    assert _run(weights, data, whole, "--top-k", "3") == 0
    stopped = tmp_path / "stopped.jsonl"
    parts = tmp_path / "stopped.jsonl.parts"
    parts.mkdir()
    (parts / "rank-00000.jsonl").write_text(whole.read_text().splitlines(keepends=True)[0])
    (parts / "options.json").write_text(json.dumps({"weights_format": "torchscript", "decode": "pil",
                                                    "dtype": "float32"}))  # as the stopped run scored
    with caplog.at_level(logging.ERROR, logger="models.predict"):
        assert _run(weights, data, stopped, "--top-k", "2", "--decode", "pil") == 2
        assert "--top-k 2, but" in caplog.text and "holds answers of --top-k 3" in caplog.text
        caplog.clear()
        assert _run(weights, data, stopped, "--top-k", "3") == 2  # the tensor decode path, auto's on a CPU
        assert "scored otherwise (" in caplog.text and "decode pil then, tensor now" in caplog.text
    assert (parts / "rank-00000.jsonl").read_text() == whole.read_text().splitlines(keepends=True)[0]  # untouched
    assert _run(weights, data, whole, "--top-k", "2") == 2  # a finished output: its answers' width


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_a_full_disk_is_said_in_one_line_and_leaves_no_temporary_file(weights: Path, picture: bytes, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    # Before: a disk full while the embeddings merged killed the process with SIGBUS, nothing said, its temporary
    # file (gigabytes at scale) left for good; full while scoring, a traceback and exit 1 (every input failed).
    data = tmp_path / "photos"
    data.mkdir()
    (data / "one.jpg").write_bytes(picture)

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with caplog.at_level(logging.ERROR, logger="models.predict"):
        assert _run(weights, data, tmp_path / "scores.jsonl", "--embeddings", str(tmp_path / "e.npy")) == 3
    assert "No space left on device" in caplog.text and "run the same command again" in caplog.text
    assert not list(tmp_path.glob(".e.npy*")) and (tmp_path / "scores.jsonl.parts").is_dir()  # what was scored


def test_an_output_inside_the_data_folder_an_empty_file_and_a_path_named_twice_are_said_plainly(
        weights: Path, picture: bytes, tmp_path: Path, no_load: None, caplog: pytest.LogCaptureFixture) -> None:
    # Before: an --out inside --data was written, and its rerun scored the outputs as inputs (a line of error
    # each); a 0-byte --data said "holds no files"; a list naming a path twice did not say which.
    data = tmp_path / "photos"
    data.mkdir()
    (data / "one.jpg").write_bytes(picture)
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    twice = tmp_path / "twice.txt"
    twice.write_text("photos/one.jpg\nphotos/one.jpg\n")
    with caplog.at_level(logging.ERROR, logger="models.predict"):
        assert _run(weights, data, data / "scores.jsonl") == 2
        assert _run(weights, data, tmp_path / "s.jsonl", "--embeddings", str(data / "sub" / "e.npy")) == 2
        assert _run(weights, empty, tmp_path / "s.jsonl") == 2
        assert _run(weights, twice, tmp_path / "s.jsonl") == 2
    said = [r.getMessage() for r in caplog.records]
    assert f"--out {data / 'scores.jsonl'} is inside --data {data}" in said[0]
    assert "--embeddings" in said[1] and "is inside --data" in said[1]
    assert "is empty (0 bytes): neither an image nor a list of files" in said[2]
    assert "names 'photos/one.jpg' twice; each path is one output line" in said[3]
