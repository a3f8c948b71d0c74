"""python -m models.predict (#34): the served artefact scores a folder or a file list in process; unreadable files
get their reason, a rerun skips what is written, the answers equal the server's, an evaluation equals the training
script's evaluate(), and two torchrun processes write the same file as one."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from app.config import Settings
from app.engine.decoding.image import DecodeLimits, image_to_tensor
from app.engine.loaded.predictor import Predictor
from app.engine.decoding.tensor import image_to_tensor_path
from demo_data.small_sets import write_digits
from harness.photos import jpeg, photo
from models import train
from models.architectures import build_model
from models.data.folder import FolderDataset
from models.export.write import export_model
from models.predict.__main__ import main
from models.predict.decode import Limits
from models.predict.inputs import Item, Labels, chunks_for_rank, list_inputs
from models.presets import EvalPreset, eval_transform
from models.run.distributed import DistEnv
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


def test_a_folder_is_scored_in_order_with_the_unreadable_files_named(weights: Path, photos: Path,
                                                                    tmp_path: Path) -> None:
    out = tmp_path / "scores.jsonl"
    assert main(["--weights", str(weights), "--data", str(photos), "--out", str(out), "--top-k", "3",
                 "--batch-size", "4", "--workers", "1"]) == 0
    lines = _lines(out)
    assert [line["path"] for line in lines] == [item.path for item in list_inputs(photos)]
    by_name = {Path(line["path"]).name: line for line in lines}
    assert "not an image" in by_name["notes.txt"]["error"] and "corrupt or truncated" in by_name["truncated.jpg"]["error"]
    good = [line for line in lines if "error" not in line]
    assert len(good) == 10 and all(len(line["labels"]) == 3 and line["labels"][0] in DIGITS for line in good)
    assert all(line["scores"] == sorted(line["scores"], reverse=True) for line in good)
    assert {(line["model"], line["version"]) for line in lines} == {("digits", "1")}
    assert not (tmp_path / "scores.jsonl.parts").exists()


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


def test_the_answers_equal_the_servers_for_the_same_files(weights: Path, photos: Path, tmp_path: Path) -> None:
    # The server as it loads by default on the CPU (frozen TorchScript), each image alone through its decode paths.
    server = Predictor.load(weights, device="cpu", jit_optimize=True)
    limits = DecodeLimits.from_settings(Settings())
    assert Limits() == Limits(limits.max_pixels, limits.max_aspect_ratio, limits.jpeg_draft_min_side)
    for path, decode in (("tensor", lambda data: image_to_tensor_path(data, server.tensor_transform, limits)),
                         ("pil", lambda data: image_to_tensor(data, server.transform, limits))):
        out = tmp_path / f"{path}.jsonl"
        assert main(["--weights", str(weights), "--data", str(photos), "--out", str(out), "--decode", path,
                     "--batch-size", "4", "--workers", "0", "--top-k", "10"]) == 0
        for line in _lines(out):
            if "error" in line:
                continue
            served = server.predict_batch(decode(Path(line["path"]).read_bytes()).unsqueeze(0))[0]
            scores, classes = served.topk(10)
            assert line["labels"][0] == DIGITS[int(classes[0])], (path, line["path"])
            assert torch.allclose(torch.tensor(line["scores"]), scores, atol=1e-5)


@pytest.mark.slow  # its run exports ONNX
def test_on_the_cpu_it_scores_with_onnx_runtime_when_the_server_would(photos: Path, tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    # An export with its ONNX file: auto on the CPU serves it (models/export/choose.py), here as in the server.
    weights = export_tiny(tmp_path / "onnx", packages=(("onnx", "float32"),))
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
        scores, _ = server.predict_batch(image.unsqueeze(0))[0].topk(3)
        assert torch.allclose(torch.tensor(line["scores"]), scores, atol=1e-5)


def test_an_evaluation_equals_the_training_scripts_evaluate(weights: Path, digits: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval.jsonl"
    # evaluate() runs PIL's eval transform (what training validates with): the pil decode path is the same pixels.
    assert main(["--weights", str(weights), "--data", str(digits), "--labels", str(digits), "--out", str(out),
                 "--decode", "pil", "--workers", "1"]) == 0
    report = tmp_path / "eval-report"
    metrics = json.loads((report / "metrics.json").read_text())
    confusion = json.loads((report / "confusion.json").read_text())

    samples = [(Path(item.file), DIGITS.index(Path(item.file).parent.name)) for item in list_inputs(digits)]
    model = build_model("resnet18", 10)
    model.load_state_dict(torch.load(weights / "model.state_dict.pt", weights_only=True))
    loader = DataLoader(FolderDataset(samples, eval_transform(EvalPreset(resize_size=36, crop_size=32))),
                        batch_size=32)
    expected = train.evaluate(model, loader, torch.device("cpu"), DistEnv())
    assert metrics["count"] == expected.count == 359
    assert metrics["acc1"] == pytest.approx(expected.acc1) and metrics["acc5"] == pytest.approx(expected.acc5)
    counts = train.confusion_counts(expected.probabilities, [t for _, t in samples], 10)
    shown = [DIGITS.index(name) for name in confusion["classes"]]
    assert confusion["matrix"] == counts[shown][:, shown].tolist()
    page = (report / "mistakes.html").read_text()
    assert page.count("<figure>") == min(60, 359 - round(expected.acc1 * 359)) and "data:image/jpeg;base64," in page
    assert (report / "confusion.png").stat().st_size > 1000


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
    assert main([*common, "--out", str(tmp_path / "one.jsonl")]) == 0
    done = torchrun(["--standalone", "--nproc_per_node=2", "-m", "models.predict", *common,
                     "--out", str(tmp_path / "two.jsonl")])
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "two.jsonl").read_text() == (tmp_path / "one.jsonl").read_text()
