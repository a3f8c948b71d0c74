"""python -m models.predict (#34): the served artefact scores a folder or a file list in process; unreadable files
get their reason, a rerun skips what is written, the answers equal the server's, an evaluation equals the training
script's evaluate(), and two torchrun processes write the same file (and embeddings) as one."""
from __future__ import annotations

import json
import logging
import re
import shlex
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from app.config import Settings
from app.engine.decoding.image import DecodeLimits, decode_image, image_to_tensor
from app.engine.loaded.predictor import Predictor
from app.errors import InvalidImage
from app.engine.decoding.tensor import image_to_tensor_path
from demo_data.small_sets import write_digits
from harness.photos import jpeg, photo
from models import train
from models.architectures import build_model
from models.data.folder import FolderDataset
from models.export.write import export_model
from models.predict.__main__ import main, quiet_handover_errors
from models.predict.inputs import Item, Labels, chunks_for_rank, list_inputs
from models.presets import EvalPreset, ServedEvalTransform
from models.run.distributed import DistEnv
from models.serving import usable_cores
from tests.support.answers import predict_error
from tests.support.fakes import export_tiny

DIGITS = [str(d) for d in range(10)]


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained resnet18 with the digits' ten classes at 32 px: outputs that differ from image to image."""
    out = tmp_path_factory.mktemp("weights")
    torch.manual_seed(0)
    export_model(build_model("resnet18", 10), out_dir=out, name="digits", version="1", arch="resnet18",
                 labels=DIGITS, preset=EvalPreset(resize_size=36, crop_size=32))
    return out


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """scikit-learn's digits as PNGs, DIR/<class>/: the val split (359 images)."""
    out = tmp_path_factory.mktemp("digits")
    write_digits(out)
    return out / "val"


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real photos as JPEGs (native and 1920x1080, one of 2600x1950 for the reduced-scale decode, one PNG) and two
    files no decoder reads."""
    out = tmp_path_factory.mktemp("photos")
    for name in ("chelsea", "coffee", "astronaut", "rocket"):
        (out / f"{name}.jpg").write_bytes(jpeg(photo(name)))
        (out / f"{name}-hd.jpg").write_bytes(jpeg(photo(name), (1920, 1080)))
    (out / "large.jpg").write_bytes(jpeg(photo("cat"), (2600, 1950)))
    photo("immunohistochemistry").save(out / "slide.png")
    (out / "notes.txt").write_text("not an image")
    (out / "truncated.jpg").write_bytes(jpeg(photo("chelsea"))[:2000])
    return out


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_a_folder_is_scored_in_order_with_the_unreadable_files_named(weights: Path, photos: Path,
                                                                    tmp_path: Path) -> None:
    out = tmp_path / "scores.jsonl"
    assert main(["--weights", str(weights), "--data", str(photos), "--out", str(out), "--top-k", "3",
                 "--batch-size", "4", "--workers", "1"]) == 0
    lines = _lines(out)
    assert torch.get_num_threads() == max(1, usable_cores() - 1)  # the forward pass: the cores 1 worker leaves
    assert [line["path"] for line in lines] == [item.path for item in list_inputs(photos)]
    by_name = {Path(line["path"]).name: line for line in lines}
    assert "not an image" in by_name["notes.txt"]["error"] and "corrupt or truncated" in by_name["truncated.jpg"]["error"]
    for name in ("notes.txt", "truncated.jpg"):  # the server's decode rules, refusing with the server's words
        with pytest.raises(InvalidImage) as served:
            decode_image((photos / name).read_bytes(), DecodeLimits())
        assert by_name[name]["error"] == served.value.message
    good = [line for line in lines if "error" not in line]
    assert len(good) == 10 and all(len(line["labels"]) == 3 and line["labels"][0] in DIGITS for line in good)
    assert all(line["scores"] == sorted(line["scores"], reverse=True) for line in good)
    assert {(line["model"], line["version"]) for line in lines} == {("digits", "1")}
    assert not (tmp_path / "scores.jsonl.parts").exists()


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_a_rerun_skips_what_is_written_and_a_stopped_run_resumes(weights: Path, photos: Path, tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    args = ["--weights", str(weights), "--data", str(photos), "--batch-size", "4", "--workers", "0"]
    whole = tmp_path / "whole.jsonl"
    assert main([*args, "--out", str(whole)]) == 0
    stopped = tmp_path / "stopped.jsonl"  # a run stopped after 5 lines, half-way through the sixth
    parts = tmp_path / "stopped.jsonl.parts"
    parts.mkdir()
    text = whole.read_text().splitlines(keepends=True)
    (parts / "rank-00000.jsonl").write_text("".join(text[:5]) + text[5][:30])
    with caplog.at_level(logging.INFO, logger="models.predict"):
        assert main([*args, "--out", str(stopped)]) == 0
        assert main([*args, "--out", str(stopped)]) == 0  # everything written: nothing to score
    # The same lines; scores within float32 rounding, since the resumed run's batches hold other neighbours.
    for resumed, first in zip(_lines(stopped), _lines(whole), strict=True):
        assert resumed | {"scores": None} == first | {"scores": None}
        assert resumed.get("scores", []) == pytest.approx(first.get("scores", []), abs=1e-6)
    said = [r.getMessage() for r in caplog.records if "inputs (" in r.getMessage()]
    assert "on 7 of 12 inputs (5 written before)" in said[0] and "on 0 of 12 inputs (12 written before)" in said[1]


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_a_rerun_refuses_to_mix_the_answers_of_two_versions(weights: Path, photos: Path, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    # Before: a run stopped, a new version landed in the repository, and the printed rerun command went on with it:
    # one file of 5 answers of version 1 and 7 of version 2.
    repository = tmp_path / "repository"
    shutil.copytree(weights, repository / "digits" / "1")
    args = ["--weights", str(repository), "--data", str(photos), "--batch-size", "4", "--workers", "0"]
    whole = tmp_path / "whole.jsonl"
    assert main([*args, "--out", str(whole)]) == 0
    out, parts = tmp_path / "scores.jsonl", tmp_path / "scores.jsonl.parts"
    parts.mkdir()
    kept = "".join(whole.read_text().splitlines(keepends=True)[:5])  # version 1's run, stopped after 5 lines
    (parts / "rank-00000.jsonl").write_text(kept)
    torch.manual_seed(1)
    export_model(build_model("resnet18", 10), out_dir=repository / "digits" / "2", name="digits", version="2",
                 arch="resnet18", labels=DIGITS, preset=EvalPreset(resize_size=36, crop_size=32))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="models.predict"):
        assert main([*args, "--out", str(out)]) == 2  # the newest is version 2 now
    (error,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert error.startswith(f"error: {out} holds answers of digits 1, not of digits 2, which this run loads: ")
    assert (parts / "rank-00000.jsonl").read_text() == kept and not out.exists()  # nothing written
    assert main([*args, "--version", "1", "--out", str(out)]) == 0  # going on with the version that wrote them
    assert {line["version"] for line in _lines(out)} == {"1"} and len(_lines(out)) == len(_lines(whole))
    # one export holds one version: no --version to go on with (before: suggested, then refused)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="models.predict"):
        assert main(["--weights", str(repository / "digits" / "2"), "--data", str(photos), "--out", str(out)]) == 2
    (error,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert error.endswith(f"which this run loads: write to another --out, or remove {out} and {parts} to start "
                          "afresh")


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_csv_output_and_parquet_without_pyarrow(weights: Path, photos: Path, tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    listed = tmp_path / "list.txt"
    listed.write_text("\n".join(str(p) for p in sorted(photos.glob("*.jpg"))[:3]) + "\n# a comment\n")
    out = tmp_path / "scores.csv"
    assert main(["--weights", str(weights), "--data", str(listed), "--out", str(out), "--workers", "0"]) == 0
    header, *rows = out.read_text().splitlines()
    assert header == ("path,label_1,score_1,label_2,score_2,label_3,score_3,label_4,score_4,label_5,score_5,"
                      "model,version,error") and len(rows) == 3
    assert main(["--weights", str(weights), "--data", str(listed), "--out", str(out), "--workers", "0"]) == 0
    assert out.read_text().splitlines()[1:] == rows  # read back to resume, written again unchanged
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        assert main(["--weights", str(weights), "--data", str(listed), "--out", str(tmp_path / "s.parquet")]) == 2
        assert "pip install pyarrow" in caplog.text


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_the_answers_equal_the_servers_for_the_same_files(weights: Path, photos: Path, tmp_path: Path) -> None:
    # The server as it loads by default on the CPU (frozen TorchScript), each image alone through its decode paths.
    server = Predictor.load(weights, device="cpu", jit_optimize=True)
    limits = DecodeLimits.from_settings(Settings())
    assert DecodeLimits() == limits  # models.predict's limits (it has no settings) are the server's defaults
    for path, decode in (("tensor", lambda data: image_to_tensor_path(data, server.tensor_transform, limits)),
                         ("pil", lambda data: image_to_tensor(data, server.transform, limits))):
        out = tmp_path / f"{path}.jsonl"
        assert main(["--weights", str(weights), "--data", str(photos), "--out", str(out), "--decode", path,
                     "--batch-size", "4", "--workers", "0", "--top-k", "10"]) == 0
        for line in _lines(out):
            if "error" in line:
                continue
            served = server.probabilities(decode(Path(line["path"]).read_bytes()).unsqueeze(0))[0]
            scores, classes = served.topk(10)
            assert line["labels"][0] == DIGITS[int(classes[0])], (path, line["path"])
            assert torch.allclose(torch.tensor(line["scores"]), scores, atol=1e-5)


@pytest.mark.slow  # its run exports ONNX
def test_on_the_cpu_it_scores_with_onnx_runtime_when_the_server_would(photos: Path, tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    # An export with its ONNX file: auto on the CPU serves it (models/export/choose.py), here as in the server.
    with caplog.at_level(logging.INFO, logger="models.export"):
        weights = export_tiny(tmp_path / "onnx", packages=(("onnx", "float32"),))
    # The largest difference unrounded: the manifest's 4 decimals had it print "probabilities within 0".
    assert re.search(r"wrote model\.onnx in \d+s: .* probabilities within \d\.\de[-+]\d\d$", caplog.text, flags=re.M)
    caplog.clear()
    server = Predictor.load(weights, device="cpu", jit_optimize=True, threads=1)
    assert server.weights_format == "onnx"
    limits = DecodeLimits.from_settings(Settings())
    out = tmp_path / "onnx.jsonl"
    with caplog.at_level(logging.INFO):
        assert main(["--weights", str(weights), "--data", str(photos), "--out", str(out), "--decode", "tensor",
                     "--batch-size", "4", "--workers", "0", "--top-k", "3"]) == 0
    assert "(onnx, cpu, float32)" in caplog.text
    for line in (line for line in _lines(out) if "error" not in line):
        image = image_to_tensor_path(Path(line["path"]).read_bytes(), server.tensor_transform, limits)
        scores, _ = server.probabilities(image.unsqueeze(0))[0].topk(3)
        assert torch.allclose(torch.tensor(line["scores"]), scores, atol=1e-5)


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_an_evaluation_equals_the_training_scripts_evaluate(weights: Path, digits: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval.jsonl"
    # evaluate() runs what training validates with, the server's CPU preprocessing: models.predict's default.
    assert main(["--weights", str(weights), "--data", str(digits), "--labels", str(digits), "--out", str(out),
                 "--workers", "1"]) == 0
    report = tmp_path / "eval-report"
    metrics = json.loads((report / "metrics.json").read_text())
    confusion = json.loads((report / "confusion.json").read_text())

    samples = [(Path(item.file), DIGITS.index(Path(item.file).parent.name)) for item in list_inputs(digits)]
    model = build_model("resnet18", 10)
    model.load_state_dict(torch.load(weights / "model.state_dict.pt", weights_only=True))
    loader = DataLoader(FolderDataset(samples, ServedEvalTransform(EvalPreset(resize_size=36, crop_size=32)),
                                      served_decode=True), batch_size=32)
    expected = train.evaluate(model, loader, torch.device("cpu"), DistEnv())
    assert metrics["count"] == expected.count == 359
    assert metrics["acc1"] == pytest.approx(expected.acc1) and metrics["acc5"] == pytest.approx(expected.acc5)
    counts = train.confusion_counts(expected.probabilities, [t for _, t in samples], 10)
    shown = [DIGITS.index(name) for name in confusion["classes"]]
    assert confusion["matrix"] == counts[shown][:, shown].tolist()
    page = (report / "mistakes.html").read_text()
    assert page.count("<figure>") == min(60, 359 - round(expected.acc1 * 359)) and "data:image/jpeg;base64," in page
    assert (report / "confusion.png").stat().st_size > 1000


@pytest.mark.slow  # seconds: a folder scored, then one image (the fast subset stays under a minute)
def test_one_image_is_scored_as_the_folder_s_run_scores_it(weights: Path, photos: Path, tmp_path: Path) -> None:
    # Before: --data cat.jpg was read as a file list: "line 1 is not UTF-8 text (byte 0xff): save it as UTF-8"
    folder, one = tmp_path / "folder.jsonl", tmp_path / "one.jsonl"
    assert main(["--weights", str(weights), "--data", str(photos), "--out", str(folder), "--workers", "0"]) == 0
    for name in ("coffee.jpg", "slide.png"):
        one.unlink(missing_ok=True)
        assert main(["--weights", str(weights), "--data", str(photos / name), "--out", str(one), "--workers", "0"]) == 0
        (line,) = _lines(one)
        (same,) = [row for row in _lines(folder) if row["path"] == str(photos / name)]
        assert line["path"] == str(photos / name) and line["labels"] == same["labels"]
        assert line["scores"] == pytest.approx(same["scores"], abs=1e-5)
    listed = tmp_path / "list.txt"
    listed.write_text("coffee.jpg\n")  # a file list is still one
    assert list_inputs(listed) == [Item("coffee.jpg", str(tmp_path / "coffee.jpg"))]
    listed.write_text("BMW_001.jpg\nBMW_002.jpg\n")  # was taken for a BMP by its first two bytes
    assert [item.path for item in list_inputs(listed)] == ["BMW_001.jpg", "BMW_002.jpg"]
    bmp = tmp_path / "one.bmp"
    Image.new("RGB", (3, 2)).save(bmp)
    assert list_inputs(bmp) == [Item(str(bmp), str(bmp))]


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_a_list_s_line_found_only_from_the_current_folder_is_said_so(weights: Path, photos: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: "cannot read the file: No such file or directory" alone, for a path that exists from where one stands
    # (nothing scored: exit 1)
    (tmp_path / "data").mkdir()
    shutil.copy(photos / "coffee.jpg", tmp_path / "data" / "coffee.jpg")
    (tmp_path / "lists").mkdir()
    (tmp_path / "lists" / "list.txt").write_text("data/coffee.jpg\n")
    monkeypatch.chdir(tmp_path)
    assert main(["--weights", str(weights), "--data", "lists/list.txt", "--out", "s.jsonl", "--workers", "0"]) == 1
    (line,) = _lines(tmp_path / "s.jsonl")
    assert line["error"] == ("cannot read the file: No such file or directory (a list's paths are relative to the "
                             "list's folder: this one is read as lists/data/coffee.jpg; data/coffee.jpg is found from "
                             "the current folder)")


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_labels_from_a_csv_and_unknown_classes(weights: Path, digits: Path, tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    files = sorted((digits / "3").iterdir())[:2]
    table = tmp_path / "labels.csv"
    table.write_text(f"path,label\n{files[0]},3\n{files[1]},three\n")
    labels = Labels(table)
    assert labels.of(Item("x", str(files[0]))) == "3" and labels.of(Item("y", str(digits / "4" / "a.png"))) is None
    assert Labels(digits).of(Item("z", str(files[1]))) == "3"
    assert main(["--weights", str(weights), "--data", str(digits / "3"), "--labels", str(table),
                 "--out", str(tmp_path / "e.jsonl")]) == 2
    assert "classes the model does not have: three" in caplog.text


def test_every_rank_gets_whole_batches_in_turn() -> None:
    items = [Item(str(i), str(i)) for i in range(10)]
    assert [[i.path for i in b] for b in chunks_for_rank(items, 3, 1, 2)] == [["3", "4", "5"], ["9"]]
    assert sum(len(b) for rank in range(3) for b in chunks_for_rank(items, 4, rank, 3)) == 10


@pytest.mark.slow
def test_two_torchrun_processes_write_the_same_file_as_one(weights: Path, photos: Path, tmp_path: Path,
                                                           torchrun) -> None:
    data = tmp_path / "photos"
    shutil.copytree(photos, data)
    common = ["--weights", str(weights), "--data", str(data), "--batch-size", "2", "--workers", "1"]
    assert main([*common, "--out", str(tmp_path / "one.jsonl"), "--embeddings", str(tmp_path / "one.npy")]) == 0
    done = torchrun(["--standalone", "--nproc_per_node=2", "-m", "models.predict", *common,
                     "--out", str(tmp_path / "two.jsonl"), "--embeddings", str(tmp_path / "two.npy")])
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "two.jsonl").read_text() == (tmp_path / "one.jsonl").read_text()
    # The embeddings too (#52): each rank's rows merged in input order, the names beside them alike.
    assert (tmp_path / "two.names.txt").read_text() == (tmp_path / "one.names.txt").read_text()
    one, two = np.load(tmp_path / "one.npy"), np.load(tmp_path / "two.npy")
    assert one.shape == two.shape == (10, 512) and np.abs(one - two).max() < 1e-6


def _stop_line(caplog: pytest.LogCaptureFixture) -> str:
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stopped")]
    return line


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_ctrl_c_says_what_is_written_and_the_command_that_goes_on(weights: Path, photos: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    # Before: a 30-line KeyboardInterrupt traceback from inside the forward pass, and nothing about resuming.
    from models.predict import __main__ as predict
    from models.commands import python_command

    real, calls = predict._answers, []

    def interrupted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C during the second batch's forward pass
        return real(*args, **kwargs)

    monkeypatch.setattr(predict, "_answers", interrupted)
    out = tmp_path / "out" / "scores.jsonl"
    argv = ["--weights", str(weights), "--data", str(photos), "--out", str(out), "--batch-size", "4",
            "--workers", "0"]
    with caplog.at_level(logging.INFO, logger="models.predict"):
        assert main(argv) == 130
    line = _stop_line(caplog)
    assert line.startswith(f"stopped: 4 of 12 inputs are written ({out}.parts)"), line
    command = line.split("is written): ", 1)[1]
    assert command == f"{python_command()} -m models.predict {' '.join(argv)}"
    monkeypatch.setattr(predict, "_answers", real)
    words = shlex.split(command)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="models.predict"):
        assert main(words[3:]) == 0  # the printed command goes on: the 8 inputs left
    assert "on 8 of 12 inputs (4 written before)" in caplog.text
    whole = tmp_path / "whole.jsonl"
    assert main([*argv[:4], "--out", str(whole), *argv[6:]]) == 0
    for resumed, straight in zip(_lines(out), _lines(whole), strict=True):
        assert resumed | {"scores": None} == straight | {"scores": None}
        assert resumed.get("scores", []) == pytest.approx(straight.get("scores", []), abs=1e-6)


def test_ctrl_c_before_anything_is_written_says_so(weights: Path, photos: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    from models.predict import __main__ as predict

    def interrupted(*args: object, **kwargs: object) -> object:
        raise KeyboardInterrupt  # during the load

    monkeypatch.setattr(predict, "load_model", interrupted)
    with caplog.at_level(logging.INFO, logger="models.predict"):
        assert main(["--weights", str(weights), "--data", str(photos), "--out", str(tmp_path / "s.csv")]) == 130
    assert _stop_line(caplog).startswith("stopped before any image was scored; to start again: ")


def test_a_worker_prints_no_broken_hand_over_and_every_other_error(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import multiprocessing
    import sys

    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    quiet_handover_errors(0)
    for dropped in (EOFError(), ConnectionResetError(104, "Connection reset by peer"),
                    multiprocessing.AuthenticationError("digest sent was rejected")):
        sys.excepthook(type(dropped), dropped, None)  # as multiprocessing's hand-over thread reports them
    assert capsys.readouterr().err == ""
    sys.excepthook(ValueError, ValueError("a real bug"), None)
    assert "ValueError: a real bug" in capsys.readouterr().err


@pytest.mark.slow  # a real Ctrl-C: the command in a subprocess, its DataLoader worker signalled too
def test_a_real_ctrl_c_prints_one_line_and_no_traceback(weights: Path, tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys

    from PIL import Image

    inputs = 600  # enough that Ctrl-C comes mid-run (after 20), few enough that the rest is quick to score
    data = tmp_path / "many"
    data.mkdir()
    for i in range(inputs):
        Image.new("RGB", (36, 36), (i % 256, (7 * i) % 256, 90)).save(data / f"{i:05d}.png")
    out = tmp_path / "scores.jsonl"
    argv = ["--weights", str(weights), "--data", str(data), "--out", str(out), "--batch-size", "1",
            "--workers", "1"]

    def as_a_terminal() -> None:  # its own process group, signalled as a whole; SIGINT as in a terminal
        os.setsid()
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    root = Path(__file__).resolve().parents[2]
    process = subprocess.Popen([sys.executable, "-m", "models.predict", *argv], cwd=root, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, preexec_fn=as_a_terminal)
    part = Path(f"{out}.parts") / "rank-00000.jsonl"
    deadline = time.monotonic() + 120
    while process.poll() is None and time.monotonic() < deadline and (
            not part.exists() or part.read_text().count("\n") < 20):
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C does: every process of the terminal's group
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    (line,) = [line for line in err.splitlines() if "stopped" in line]
    written = len(part.read_text().splitlines())
    assert f"stopped: {written} of {inputs} inputs are written" in line
    command = line.split("is written): ", 1)[1]
    assert shlex.split(command)[0] == ".venv/bin/python" or Path(shlex.split(command)[0]).is_absolute()
    done = subprocess.run(command, shell=True, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"on {inputs - written} of {inputs} inputs ({written} written before)" in done.stderr
    assert len(_lines(out)) == inputs


def test_a_repository_of_several_models_is_read_at_the_default_its_repository_json_names(weights: Path,
                                                                                          tmp_path: Path) -> None:
    # Before: "a repository of 2 models ...: name one, --model", where the server serves repository.json's default
    from models.predict.__main__ import weights_folder
    from models.run.args import DataError

    repository = tmp_path / "repository"
    for name in ("digits", "other"):
        shutil.copytree(weights, repository / name / "1")
    with pytest.raises(DataError, match=r"a repository of 2 models \(digits, other\) and no repository.json names its "
                                        "default: name one, --model"):
        weights_folder(repository, None, None)
    (repository / "repository.json").write_text('{"default_model": "other"}')
    assert weights_folder(repository, None, None) == repository / "other" / "1"
    assert weights_folder(repository, "digits", None) == repository / "digits" / "1"


def test_wrong_paths_are_named_before_the_model_loads(weights: Path, photos: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    # Before: a missing --weights and a folder of photos both said "holds 0 models (none): name one, --model", and
    # --data and --out were read only after the model had loaded.
    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the paths were checked")

    monkeypatch.setattr("models.predict.__main__.load_model", no_load)
    out = str(tmp_path / "s.jsonl")
    missing = tmp_path / "runs" / "nothing" / "export"
    assert predict_error(["--weights", str(missing), "--data", str(photos), "--out", out], caplog) == (
        f"error: --weights {missing} does not exist: give an export's folder (with manifest.json) or a model "
        "repository")
    assert predict_error(["--weights", str(photos), "--data", str(photos), "--out", out], caplog) == (
        f"error: --weights {photos} is not an export (no manifest.json in it) nor a model repository "
        "(no <model>/<version>/manifest.json under it)")
    run = tmp_path / "runs" / "mine"  # a run's folder or its checkpoint for its export: the export named
    shutil.copytree(weights, run / "export")
    (run / "best.pt").write_bytes(b"")
    for given_weights in (run, run / "best.pt"):
        assert predict_error(["--weights", str(given_weights), "--data", str(photos), "--out", out], caplog).endswith(
            f"; {run / 'export'} is an export: --weights {run / 'export'}")
    given = ["--weights", str(weights)]
    assert "--data " + str(tmp_path / "gone") + " does not exist" in predict_error(
        [*given, "--data", str(tmp_path / "gone"), "--out", out], caplog)
    assert "--data /dev/null is neither a folder nor a file list" in predict_error(
        [*given, "--data", "/dev/null", "--out", out], caplog)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert f"--out {blocker / 'x.jsonl'}: its folder {blocker} cannot be made (a file is in the way)" in predict_error(
        [*given, "--data", str(photos), "--out", str(blocker / "x.jsonl")], caplog)
    assert f"--out {tmp_path} is a folder" in predict_error([*given, "--data", str(photos), "--out", str(tmp_path)], caplog)
    assert "write .jsonl, .csv or .parquet" in predict_error([*given, "--data", str(photos), "--out", out + ".txt"], caplog)
    assert "is neither a DIR/<class>/ folder nor a CSV" in predict_error(
        [*given, "--data", str(photos), "--out", out, "--labels", str(tmp_path / "no-labels")], caplog)


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_a_training_folder_as_labels_names_the_split_to_evaluate(weights: Path, digits: Path, tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    # Before: --labels data/mine on the docs' own train/ + val/ folder said "--labels names classes the model does
    # not have: train, val".
    mine = tmp_path / "mine"
    for split, count in (("train", 3), ("val", 2)):
        for digit in ("3", "8"):
            (mine / split / digit).mkdir(parents=True)
            for file in sorted((digits / digit).iterdir())[:count]:
                shutil.copy(file, mine / split / digit / file.name)
    out = tmp_path / "eval.jsonl"
    line = predict_error(["--weights", str(weights), "--data", str(mine), "--labels", str(mine), "--out", str(out)], caplog)
    assert line == (f"error: --labels {mine} holds the training splits train/ and val/, not <class>/ folders: "
                    f"evaluate on the split training held out, --data {mine / 'val'} --labels {mine / 'val'}")
    assert not out.exists() and not Path(f"{out}.parts").exists()  # nothing scored
    suggested = shlex.split(line.rsplit("held out, ", 1)[1])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="models.predict"):
        assert main(["--weights", str(weights), *suggested, "--out", str(out), "--workers", "0"]) == 0
    assert "evaluated 4 images: top-1" in caplog.text and f"report in {tmp_path / 'eval-report'}" in caplog.text
    assert json.loads((tmp_path / "eval-report" / "metrics.json").read_text())["count"] == 4


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_the_report_goes_beside_out_and_a_page_without_mistakes_says_so(weights: Path, photos: Path,
                                                                        tmp_path: Path) -> None:
    # Before: with no mistakes mistakes.html said "0 most confident mistakes: ...".
    scored = tmp_path / "scored.jsonl"
    args = ["--weights", str(weights), "--data", str(photos), "--workers", "0", "--batch-size", "4"]
    assert main([*args, "--out", str(scored)]) == 0
    table = tmp_path / "truth.csv"  # the model's own answers as the truth: no mistakes
    table.write_text("".join(f"{line['path']},{line['labels'][0]}\n" for line in _lines(scored) if "error" not in line))
    assert main([*args, "--labels", str(table), "--out", str(tmp_path / "run" / "eval.jsonl")]) == 0
    page = (tmp_path / "run" / "eval-report" / "mistakes.html").read_text()
    assert "No mistakes: the model's top-1 answer was right on all 10 labelled images scored." in page
    assert "0 most confident" not in page and "<figure>" not in page
    wrong = tmp_path / "wrong.csv"  # three of them now wrong: all three shown, and said to be all
    rows = table.read_text().splitlines()
    wrong.write_text("\n".join(f"{row.rsplit(',', 1)[0]},{'0' if row.endswith(',1') else '1'}" if i < 3 else row
                               for i, row in enumerate(rows)) + "\n")
    assert main([*args, "--labels", str(wrong), "--out", str(tmp_path / "wrong.jsonl"), "--mistakes", "2"]) == 0
    page = (tmp_path / "wrong-report" / "mistakes.html").read_text()
    assert "The 2 most confident of 3 mistakes: " in page and page.count("<figure>") == 2


def test_a_linked_class_folder_is_scored_as_training_reads_it_and_other_links_to_folders_are_not(tmp_path: Path) -> None:
    # Before: os.walk without its links followed: models.predict --data left a linked class folder's images out,
    # which training took, and its report said "support 0" for the class (a data scientist's trial).
    from models.data.folder import class_files

    elsewhere, data = tmp_path / "elsewhere" / "astronaut", tmp_path / "data"
    elsewhere.mkdir(parents=True)
    (data / "rocket").mkdir(parents=True)
    (elsewhere / "a.jpg").write_bytes(b"x")
    (elsewhere / "b.jpg").write_bytes(b"x")
    (data / "rocket" / "r.jpg").write_bytes(b"x")
    (data / "astronaut").symlink_to(elsewhere)
    (data / "rocket" / "up").symlink_to(data)  # a link further down: not followed (a loop, here)
    (data / "everything").symlink_to(tmp_path)  # a link above the folder: not followed (all of it again)
    (data / "rocket" / ".hidden").mkdir()
    (data / "rocket" / ".hidden" / "h.jpg").write_bytes(b"x")
    scanned = [item.path for item in list_inputs(data)]
    assert scanned == [str(data / "astronaut" / "a.jpg"), str(data / "astronaut" / "b.jpg"),
                       str(data / "rocket" / "r.jpg")]  # the links passed over, the hidden folder left out
    (data / "everything").unlink()  # (training would take it for a class)
    assert [str(path) for path in class_files(data)] == scanned  # training reads the same
