"""models.predict --embeddings (#52): each scored image's embedding from the forward pass that scores it, in the
records' order, with its path in the names file beside; resumable as the records are; a model exported without an
embedding named before it loads; and the issue's acceptance test: with the real default model, flipped and cropped
copies of real photos find their original as their nearest neighbour."""
from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import skimage.data
import torch
from PIL import Image, ImageOps

from harness.photos import jpeg, photo
from models.architectures import split_outputs
from models.export.load import load_model
from models.neighbours import main as neighbours, like, read_embeddings
from models.predict import __main__ as predict
from models.predict.__main__ import main
from models.predict.decode import ScoreSet
from models.predict.inputs import list_inputs
from models.predict.outputs import embeddings_part, meta_file, names_file, part_file
from tests.support.answers import predict_error
from tests.support.fakes import export_tiny

DIM = 1024  # export_tiny's mobilenet_v3_small: its head's input


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_tiny(tmp_path_factory.mktemp("tiny") / "export")


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Seven real photos as JPEGs (one of them PNG) and two files no decoder reads."""
    out = tmp_path_factory.mktemp("photos")
    for name in ("chelsea", "coffee", "astronaut", "rocket"):
        (out / f"{name}.jpg").write_bytes(jpeg(photo(name)))
    (out / "chelsea-hd.jpg").write_bytes(jpeg(photo("chelsea"), (1920, 1080)))
    (out / "more").mkdir()
    (out / "more" / "coffee-small.jpg").write_bytes(jpeg(photo("coffee"), (200, 150)))
    photo("immunohistochemistry").save(out / "more" / "slide.png")
    (out / "notes.txt").write_text("not an image")
    (out / "truncated.jpg").write_bytes(jpeg(photo("rocket"))[:2000])
    return out


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _argv(weights: Path, data: Path, out: Path, *more: str) -> list[str]:
    return ["--weights", str(weights), "--data", str(data), "--out", str(out), "--workers", "0", "--batch-size", "3",
            *more]


@pytest.mark.slow  # scoring runs of seconds each
def test_each_scored_image_s_embedding_comes_from_its_one_forward_pass_in_the_records_order(
        tiny: Path, photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    passes: list[int] = []
    real_load = predict.load_model

    def counted(*args: object, **kwargs: object) -> object:  # the served module, each call counted
        loaded = real_load(*args, **kwargs)
        module = loaded.module

        def forward(images: torch.Tensor) -> object:
            passes.append(len(images))
            return module(images)

        return dataclasses.replace(loaded, module=forward)

    monkeypatch.setattr(predict, "load_model", counted)
    out, embeddings = tmp_path / "scores.jsonl", tmp_path / "emb" / "photos.npy"
    assert main(_argv(tiny, photos, out, "--embeddings", str(embeddings))) == 0
    records = _lines(out)
    scored = [r["path"] for r in records if "error" not in r]
    assert len(records) == 9 and len(scored) == 7 and sum(passes) == 7 and len(passes) == 3  # batches of 3: 3+2+2
    assert names_file(embeddings).read_text() == "".join(path + "\n" for path in scored)
    rows = np.load(embeddings)
    assert rows.dtype == np.float32 and rows.shape == (7, DIM)
    assert np.allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-5)
    assert not any(key.startswith("embedding") for r in records for key in r)  # OUT is as without --embeddings
    assert not Path(f"{out}.parts").exists()
    # Each row is the served model's embedding of that file, preprocessed as the command does (tensor path).
    loaded = load_model(tiny, device="cpu")
    items = {item.path: item for item in list_inputs(photos)}
    images = ScoreSet([items[path] for path in scored], loaded.manifest.preprocess, "tensor")
    with torch.inference_mode():
        _, expected = split_outputs(loaded.module(torch.stack([images[i][1] for i in range(len(scored))])))
    assert np.abs(rows - expected.numpy()).max() < 1e-5
    plain = tmp_path / "plain.jsonl"
    assert main(_argv(tiny, photos, plain)) == 0
    assert plain.read_text() == out.read_text()  # the records are the same with --embeddings or without


@pytest.mark.slow  # scoring runs of seconds each
def test_a_stopped_run_resumes_to_the_same_embeddings_as_an_uninterrupted_one(
        tiny: Path, photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    whole, whole_rows = tmp_path / "whole.jsonl", tmp_path / "whole.npy"
    assert main(_argv(tiny, photos, whole, "--embeddings", str(whole_rows))) == 0
    real, calls = predict._answers, []

    def interrupted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C in the second batch's forward pass
        return real(*args, **kwargs)

    monkeypatch.setattr(predict, "_answers", interrupted)
    out, rows = tmp_path / "out" / "scores.jsonl", tmp_path / "out" / "photos.npy"
    argv = _argv(tiny, photos, out, "--embeddings", str(rows))
    with caplog.at_level(logging.INFO, logger="models.predict"):
        assert main(argv) == 130
    assert "stopped: 3 of 9 inputs are written" in caplog.text and not rows.exists()
    part = part_file(out, 0)
    rows_part = embeddings_part(part, DIM)
    assert rows_part.stat().st_size == 3 * DIM * 4  # the first batch's three rows, named by its records
    with rows_part.open("ab") as handle:  # a crash in the middle of the next batch: half a row, half a record
        handle.write(b"\x01" * 1000)
    with part.open("a") as handle:
        handle.write('{"path": "half')
    monkeypatch.setattr(predict, "_answers", real)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="models.predict"):
        assert main(argv) == 0
    assert "on 6 of 9 inputs (3 written before)" in caplog.text
    assert f"wrote {rows}: 7 embeddings of {DIM} values, their paths in {names_file(rows)}" in caplog.text
    assert names_file(rows).read_text() == names_file(whole_rows).read_text()
    # The resumed run's batches hold other neighbours: the same rows within float32 rounding.
    assert np.abs(np.load(rows) - np.load(whole_rows)).max() < 1e-5
    assert [r["path"] for r in _lines(out)] == [r["path"] for r in _lines(whole)]


@pytest.mark.slow  # scoring runs of seconds each
def test_a_rerun_scores_what_has_no_embedding_and_keeps_the_rows_written(tiny: Path, photos: Path, tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    data = tmp_path / "photos"
    shutil.copytree(photos, data)
    out, rows = tmp_path / "scores.jsonl", tmp_path / "photos.npy"
    assert main(_argv(tiny, data, out)) == 0  # scored before, without --embeddings: every image again
    with caplog.at_level(logging.INFO, logger="models.predict"):
        assert main(_argv(tiny, data, out, "--embeddings", str(rows))) == 0
    assert "on 7 of 9 inputs (2 written before)" in caplog.text  # the two unreadable files: nothing to embed
    first = np.load(rows)
    (data / "astronaut-small.jpg").write_bytes(jpeg(photo("astronaut"), (300, 300)))  # a new image
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="models.predict"):
        assert main(_argv(tiny, data, out, "--embeddings", str(rows))) == 0
    assert "on 1 of 10 inputs (9 written before)" in caplog.text
    names = names_file(rows).read_text().splitlines()
    assert names == [r["path"] for r in _lines(out) if "error" not in r] and len(names) == 8
    assert names[0].endswith("astronaut-small.jpg")  # in input order: the rows written before, moved one down
    assert np.array_equal(np.load(rows)[1:], first)


def _scored(argv: list[str], caplog: pytest.LogCaptureFixture) -> str:
    """The log of a run of ``argv`` that exits 0."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="models.predict"):
        assert main(argv) == 0
    return caplog.text


@pytest.mark.slow  # scoring runs of seconds each
def test_merged_rows_are_kept_only_for_the_model_and_out_they_were_merged_with(
        tiny: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: an EMB.npy and its names file at --embeddings were taken by their path alone: a rerun over records
    # another --out (or model) wrote scored nothing and kept the other run's rows, here another image's.
    data = tmp_path / "photos"
    data.mkdir()
    (data / "a.jpg").write_bytes(jpeg(photo("chelsea")))
    (data / "b.jpg").write_bytes(jpeg(photo("coffee")))
    rows = tmp_path / "photos.npy"
    _scored(_argv(tiny, data, tmp_path / "x.jsonl", "--embeddings", str(rows)), caplog)
    assert json.loads(meta_file(rows).read_text()) == {"model": "mine", "version": "1", "dim": DIM, "out": "x.jsonl"}
    before = np.load(rows)
    (data / "a.jpg").write_bytes(jpeg(photo("astronaut")))  # another image at the same path
    _scored(_argv(tiny, data, tmp_path / "y.jsonl"), caplog)  # its records, without --embeddings
    said = _scored(_argv(tiny, data, tmp_path / "y.jsonl", "--embeddings", str(rows)), caplog)
    assert "on 2 of 2 inputs (0 written before)" in said
    assert (f"--embeddings {rows}: its rows are not taken (merged with another --out: x.jsonl, relative to its "
            "folder); the images are scored again") in said
    fresh = tmp_path / "fresh.npy"
    _scored(_argv(tiny, data, tmp_path / "fresh.jsonl", "--embeddings", str(fresh)), caplog)
    assert np.abs(np.load(rows) - np.load(fresh)).max() < 1e-5 and np.abs(np.load(rows)[0] - before[0]).max() > 0.01
    assert json.loads(meta_file(rows).read_text())["out"] == "y.jsonl"
    said = _scored(_argv(tiny, data, tmp_path / "y.jsonl", "--embeddings", str(rows)), caplog)
    assert "on 0 of 2 inputs (2 written before)" in said and "not taken" not in said  # its own --out: kept
    meta = json.loads(meta_file(rows).read_text())
    meta_file(rows).write_text(json.dumps(meta | {"version": "0"}))  # another version's rows
    said = _scored(_argv(tiny, data, tmp_path / "y.jsonl", "--embeddings", str(rows)), caplog)
    assert "on 2 of 2 inputs (0 written before)" in said and "(its rows are of mine 0, not mine 1)" in said
    meta_file(rows).unlink()  # as written before there were meta files, or by a merge cut short
    said = _scored(_argv(tiny, data, tmp_path / "y.jsonl", "--embeddings", str(rows)), caplog)
    assert "on 2 of 2 inputs (0 written before)" in said
    assert "(no photos.meta.json beside it names the model and --out its rows are of)" in said
    capsys.readouterr()
    assert neighbours([str(rows), "--duplicates"]) == 0
    assert capsys.readouterr().err == "0 pairs at cosine similarity >= 0.95 among 2 images (mine 1's embeddings)\n"


def test_a_model_exported_without_an_embedding_is_named_before_it_loads(tiny: Path, photos: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    from models.commands import python_command

    old = tmp_path / "old"
    shutil.copytree(tiny, old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["embedding"]  # as an export written before embeddings
    (old / "manifest.json").write_text(json.dumps(manifest))
    real_load = predict.load_model

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before --embeddings was checked")

    monkeypatch.setattr(predict, "load_model", no_load)
    out, rows = tmp_path / "scores.jsonl", tmp_path / "photos.npy"
    assert predict_error(_argv(old, photos, out, "--embeddings", str(rows)), caplog) == (
        f"error: --embeddings: mine 1 in {old} was exported without an embedding (written before exports recorded "
        f"one): export it again with {python_command()} -m models.export, which records it, and score that")
    assert not out.exists() and not rows.exists() and not Path(f"{out}.parts").exists()
    assert predict_error(_argv(tiny, photos, out, "--embeddings", str(tmp_path / "e.txt")), caplog) == (
        f"error: --embeddings {tmp_path / 'e.txt'}: write a .npy file (its names go beside it, as X.names.txt "
        "beside X.npy)")
    assert predict_error(_argv(tiny, photos, out, "--embeddings", str(tmp_path)), caplog).startswith(
        f"error: --embeddings {tmp_path}: write a .npy file")
    folder = tmp_path / "rows.npy"
    folder.mkdir()
    assert predict_error(_argv(tiny, photos, out, "--embeddings", str(folder)), caplog) == (
        f"error: --embeddings {folder} is a folder: name the file to write in it, e.g. {folder / 'photos.npy'}")
    monkeypatch.setattr(predict, "load_model", real_load)  # without --embeddings the old export scores as before
    assert main(_argv(old, photos, out, "--weights-format", "state_dict")) == 0 and len(_lines(out)) == 9


# The acceptance test: copies of real photos, as near-duplicates come (mirrored, cropped, both).
ORIGINALS = ("chelsea", "coffee", "astronaut", "rocket", "immunohistochemistry", "hubble_deep_field", "coins",
             "camera", "moon", "retina", "page", "clock", "brick", "grass", "gravel", "cell", "horse", "text",
             "colorwheel", "logo")


def _crop(image: Image.Image, share: float, corner: bool) -> Image.Image:
    """``share`` of the width and height: in the middle, or at the bottom-left corner."""
    width, height = image.size
    w, h = int(width * share), int(height * share)
    left, top = (0, height - h) if corner else ((width - w) // 2, (height - h) // 2)
    return image.crop((left, top, left + w, top + h))


COPIES = {"mirrored": ImageOps.mirror, "crop75": lambda image: _crop(image, 0.75, corner=False),
          "crop80-corner": lambda image: _crop(image, 0.8, corner=True),
          "mirrored-crop70": lambda image: _crop(ImageOps.mirror(image), 0.7, corner=True)}


def test_copies_of_real_photos_find_their_original_as_nearest_neighbour(real_weights: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "photos"
    data.mkdir()
    for name in ORIGINALS:
        image = Image.fromarray(np.asarray(getattr(skimage.data, name)())).convert("RGB")
        image.save(data / f"{name}.jpg", quality=90)
        for copy, made in COPIES.items():
            made(image).save(data / f"{name}--{copy}.jpg", quality=90)
    out, rows = tmp_path / "photos.jsonl", tmp_path / "photos.npy"
    assert main(["--weights", str(real_weights), "--data", str(data), "--out", str(out), "--embeddings", str(rows),
                 "--workers", "1"]) == 0
    embeddings = read_embeddings(rows)
    assert len(embeddings.names) == len(ORIGINALS) * (1 + len(COPIES))
    found, misses = 0, []
    for index, name in enumerate(embeddings.names):
        original, _, copy = Path(name).stem.partition("--")
        if not copy:
            continue
        siblings = {f"{original}--{other}" for other in COPIES}  # the other copies of the same photo left out
        ranked = [Path(embeddings.names[j]).stem for _, j in like(embeddings, index, len(COPIES) + 1)]
        nearest = next(stem for stem in ranked if stem not in siblings)
        found += nearest == original
        misses += [f"{original}--{copy}: {ranked}"] if nearest != original else []
    copies = len(ORIGINALS) * len(COPIES)
    assert found >= 0.95 * copies, f"{found} of {copies} copies found their original: {misses}"
    # The command, as a user runs it: a photo by its base name, its copies its nearest neighbours.
    assert neighbours([str(rows), "--like", "chelsea.jpg", "--k", str(len(COPIES))]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sorted(Path(line.split()[1]).name for line in lines) == sorted(f"chelsea--{c}.jpg" for c in COPIES)


def test_a_row_the_model_answers_nan_in_is_an_error_record_and_bf16_embeddings_are_of_unit_length() -> None:
    """As the server answers them: an image whose row is NaN fails alone (an error record, rescored by
    --retry-errors), never scores of NaN; an embedding normalised in bfloat16 is normalised again in float32."""
    embeddings = torch.nn.functional.normalize(torch.randn(3, 64), dim=1).to(torch.bfloat16)
    logits = torch.tensor([[2.0, 0.5], [float("nan"), 1.0], [0.1, 0.3]])

    class Answering(torch.nn.Module):
        def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return logits.to(torch.bfloat16), embeddings

    loaded = type("Loaded", (), {"module": Answering(), "manifest": type("M", (), {"labels": ["cat", "dog"]})()})()
    items = [type("Item", (), {"path": f"{i}.jpg"})() for i in range(3)]
    records, vectors = predict._answers(loaded, torch.zeros(3, 3, 8, 8), [0, 1, 2], items, 2, {"version": "1"},
                                        embed=True)
    assert records[1] == {"path": "1.jpg", "error": predict.NON_FINITE, "version": "1"}
    assert [records[i]["labels"][0] for i in (0, 2)] == ["cat", "dog"]
    assert sorted(vectors) == [0, 2]
    for row in vectors.values():
        assert row.dtype == np.float32 and abs(float(np.dot(row, row)) - 1.0) < 1e-5
