"""python -m models.neighbours (#52): near-duplicate pairs at a threshold, most similar first, and an image's nearest
neighbours by name or a unique end of it, from the .npy and names file models.predict --embeddings writes; exact
whatever the block size, at most MAX_PAIRS pairs kept; a mistake is one line on stderr and exit code 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from models import neighbours
from models.neighbours import duplicates, like, main, read_embeddings
from models.predict.outputs import names_file

ROOT = Path(__file__).resolve().parents[2]


def _write(folder: Path, rows: np.ndarray, names: list[str], stem: str = "emb") -> Path:
    path = folder / f"{stem}.npy"
    np.save(path, rows)
    names_file(path).write_text("".join(name + "\n" for name in names))
    return path


@pytest.fixture
def hand_made(tmp_path: Path) -> Path:
    """Five images in 3-D, lengths other than 1 on purpose: a and its copy a2 (cosine 0.995), b and its copy b2
    (0.96), c apart from all. Unit vectors' dot products are the cosines; here they are scaled by 2, 3, 0.5..."""
    a = np.array([1.0, 0.0, 0.0])
    a2 = np.array([0.995, np.sqrt(1 - 0.995**2), 0.0])
    b = np.array([0.0, 1.0, 0.0])
    b2 = np.array([0.0, 0.96, np.sqrt(1 - 0.96**2)])
    c = np.array([-1.0, -1.0, 1.0]) / np.sqrt(3)
    rows = np.stack([2 * a, b, 3 * a2, c, 0.5 * b2]).astype(np.float32)
    return _write(tmp_path, rows, ["photos/a.jpg", "photos/b.jpg", "photos/copies/a2.jpg", "photos/c.jpg",
                                   "photos/copies/b2.jpg"])


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str], str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err


def test_duplicates_are_the_pairs_at_the_threshold_most_similar_first(hand_made: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, lines, err = _run([str(hand_made), "--duplicates", "--threshold", "0.95"], capsys)
    assert code == 0
    assert lines == ["0.9950  photos/a.jpg  photos/copies/a2.jpg", "0.9600  photos/b.jpg  photos/copies/b2.jpg"]
    assert err == "2 pairs at cosine similarity >= 0.95 among 5 images\n"
    code, lines, _ = _run([str(hand_made), "--duplicates", "--threshold", "0.97", "--json"], capsys)
    assert [json.loads(line) for line in lines] == [{"similarity": pytest.approx(0.995, abs=1e-6),
                                                     "a": "photos/a.jpg", "b": "photos/copies/a2.jpg"}]
    code, lines, err = _run([str(hand_made), "--duplicates"], capsys)  # the default threshold: 0.95
    assert len(lines) == 2
    _, lines, _ = _run([str(hand_made), "--duplicates", "--threshold", "0.999"], capsys)
    assert lines == []


def test_like_by_name_or_a_unique_end_of_it(hand_made: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("photos/copies/a2.jpg", "a2.jpg", "copies/a2.jpg"):
        code, lines, _ = _run([str(hand_made), "--like", name, "--k", "2"], capsys)
        assert code == 0 and lines == ["0.9950  photos/a.jpg", "0.0999  photos/b.jpg"], (name, lines)
    _, lines, _ = _run([str(hand_made), "--like", "c.jpg", "--k", "10", "--json"], capsys)
    answers = [json.loads(line) for line in lines]
    assert len(answers) == 4 and "photos/c.jpg" not in [a["name"] for a in answers]  # never itself; k capped
    assert [a["similarity"] for a in answers] == sorted((a["similarity"] for a in answers), reverse=True)
    assert answers[0]["similarity"] == pytest.approx(float(np.dot([-1, -1, 1], [0, 0.96, 0.28]) / np.sqrt(3)),
                                                     abs=1e-6)


def test_the_search_by_blocks_equals_the_whole_matrix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((60, 16)).astype(np.float32)
    rows[40:50] = rows[:10] + 0.05 * rng.standard_normal((10, 16)).astype(np.float32)  # ten planted near-copies
    path = _write(tmp_path, rows, [f"{i:02d}.jpg" for i in range(60)])
    unit = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    whole = unit @ unit.T
    first, second = np.triu_indices(60, k=1)
    expected = sorted(((-whole[i, j], i, j) for i, j in zip(first, second) if whole[i, j] >= 0.3))
    monkeypatch.setattr(neighbours, "BLOCK_BYTES", 7 * 4 * 60)  # blocks of 7 rows: the last one short
    similarities, i, j, qualified = duplicates(read_embeddings(path), 0.3)
    assert qualified == len(expected) > 10 and list(zip(i.tolist(), j.tolist())) == [(a, b) for _, a, b in expected]
    assert similarities == pytest.approx([-s for s, _, _ in expected], abs=1e-5)
    assert {(a, b) for a, b in zip(range(10), range(40, 50))} <= set(zip(i.tolist(), j.tolist()))
    nearest = like(read_embeddings(path), 42, 3)
    assert [row for _, row in nearest] == [int(k) for k in np.argsort(-np.where(np.arange(60) == 42, -9, whole[42]))[:3]]
    assert nearest[0][1] == 2


def test_at_most_max_pairs_are_kept_and_the_count_says_how_many_qualified(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((30, 8)).astype(np.float32)
    path = _write(tmp_path, rows, [f"{i}.jpg" for i in range(30)])
    monkeypatch.setattr(neighbours, "BLOCK_BYTES", 4 * 4 * 30)  # blocks of 4 rows: pruned many times
    monkeypatch.setattr(neighbours, "MAX_PAIRS", 5)
    similarities, _, _, qualified = duplicates(read_embeddings(path), -1.0)
    unit = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    best = np.sort((unit @ unit.T)[np.triu_indices(30, k=1)])[::-1][:5]
    assert qualified == 30 * 29 // 2 and similarities == pytest.approx(best, abs=1e-5)
    code, lines, err = _run([str(path), "--duplicates", "--threshold", "-1"], capsys)
    assert code == 0 and len(lines) == 5
    assert err == "435 pairs at cosine similarity >= -1.0 among 30 images (the 5 most similar shown: raise --threshold)\n"


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code, lines, err = _run(argv, capsys)
    assert code == 2 and lines == [] and err.count("\n") == 1 and err.startswith("error: "), (code, lines, err)
    return err.strip()


def test_mistakes_are_one_line_and_exit_code_2(hand_made: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "none.npy"
    assert _error([str(missing), "--duplicates"], capsys) == (
        f"error: {missing} does not exist: models.predict --embeddings {missing} writes it")
    alone = tmp_path / "alone" / "emb.npy"
    alone.parent.mkdir()
    np.save(alone, np.ones((2, 3), np.float32))
    assert _error([str(alone), "--duplicates"], capsys) == (
        f"error: {alone.parent / 'emb.names.txt'} is missing: models.predict --embeddings {alone} writes it beside "
        f"{alone}")
    short = _write(tmp_path / "alone", np.ones((3, 3), np.float32), ["x.jpg", "y.jpg"], "short")
    assert _error([str(short), "--like", "x.jpg"], capsys) == (
        f"error: {short} holds 3 rows and {names_file(short)} 2 names: they are written together, one name per "
        "row; write them again with models.predict")
    assert _error([str(hand_made), "--like", "d.jpg"], capsys) == (
        "error: --like d.jpg: no name in the names file is or ends with it (5 names, e.g. photos/a.jpg)")
    assert _error([str(hand_made), "--like", "2.jpg"], capsys).startswith(
        "error: --like 2.jpg: no name in the names file")  # an end of a name counts after a / only
    names_file(hand_made).write_text("photos/a.jpg\nphotos/b.jpg\nother/a.jpg\nphotos/c.jpg\nx/b2.jpg\n")
    assert _error([str(hand_made), "--like", "a.jpg"], capsys) == (
        "error: --like a.jpg ends 2 names (photos/a.jpg, other/a.jpg): give more of its path")
    code, lines, _ = _run([str(hand_made), "--like", "other/a.jpg", "--k", "1"], capsys)
    assert code == 0 and lines == ["0.9950  photos/a.jpg"]
    assert _error([str(hand_made), "--duplicates", "--threshold", "1.5"], capsys) == (
        "error: --threshold 1.5: a cosine similarity is between -1 and 1")
    assert _error([str(hand_made), "--like", "a.jpg", "--k", "0"], capsys) == (
        "error: --k 0: ask for at least 1 neighbour")
    text = tmp_path / "text.npy"
    text.write_text("not numpy")
    names_file(text).write_text("a\n")
    assert _error([str(text), "--duplicates"], capsys).startswith(f"error: {text} is not a .npy file numpy reads: ")


def test_it_runs_as_a_command_without_torch(hand_made: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "models.neighbours", str(hand_made), "--like", "b.jpg", "--k", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "0.9600  photos/copies/b2.jpg\n", done.stderr
    check = "import sys, models.neighbours; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", check], cwd=ROOT, timeout=60).returncode == 0


def test_exact_duplicates_are_at_threshold_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: a unit float32 row's product with itself is 0.9999994 as often as not, so --threshold 1 (the top of
    # its range) missed about a third of 200 exact duplicates.
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((200, 1280)).astype(np.float32)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    path = _write(tmp_path, np.concatenate([rows, rows]), [f"{i}.jpg" for i in range(400)])
    code, lines, err = _run([str(path), "--duplicates", "--threshold", "1"], capsys)
    assert code == 0 and err == "200 pairs at cosine similarity >= 1.0 among 400 images\n"
    assert sorted(lines) == sorted(f"1.0000  {i}.jpg  {i + 200}.jpg" for i in range(200))
    _, lines, _ = _run([str(path), "--duplicates", "--threshold", "1", "--json"], capsys)
    assert {json.loads(line)["similarity"] for line in lines} == {1.0}  # never past 1, however float32 rounds
    code, lines, _ = _run([str(path), "--like", "7.jpg", "--k", "1"], capsys)
    assert code == 0 and lines == ["1.0000  207.jpg"]


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_row_of_nan_or_infinity_is_refused_naming_its_image(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str], bad: float) -> None:
    # Before: a NaN row was taken: --like listed the image itself among its neighbours and printed NaN as -1.0000,
    # and --duplicates left its pairs out without a word.
    rows = np.array([[1, 0, 0], [0.9, 0.1, 0], [bad, 0, 0], [0, 1, 0], [bad, bad, 0]], np.float32)
    path = _write(tmp_path, rows, ["a.jpg", "b.jpg", "broken.jpg", "d.jpg", "worse.jpg"])
    monkeypatch.setattr(neighbours, "BLOCK_BYTES", 4 * 3)  # a row a block: the row counted across blocks
    for argv in (["--like", "a.jpg"], ["--like", "broken.jpg"], ["--duplicates", "--threshold", "-1"]):
        assert _error([str(path), *argv], capsys) == (
            f"error: {path}: row 2 (broken.jpg) holds NaN or infinity, which no similarity compares: score that "
            "image again (models.predict writes no such row)")


def test_names_are_split_at_line_ends_alone_and_printed_as_the_names_file_holds_them(
        tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    # Before: the names file was read with splitlines(), which also splits at a form feed, U+2028 or U+0085 that a
    # file name may hold (more names than rows: exit 2), and as strict UTF-8: a name that is not (models.predict
    # writes its own bytes) was a UnicodeDecodeError traceback.
    path = tmp_path / "emb.npy"
    np.save(path, np.array([[1, 0], [0.99, 0.141], [0, 1], [0.1, 1]], np.float32))
    names_file(path).write_bytes(b"photos/a.jpg\nphotos/bad-\xff.jpg\nphotos/c\x0cd\xe2\x80\xa8e.jpg\n"
                                 b"photos/f\xc2\x85g.jpg\n")

    def run(*argv: str | bytes) -> bytes:
        done = subprocess.run([sys.executable, "-m", "models.neighbours", str(path), *argv], cwd=ROOT,
                              capture_output=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert run("--like", "a.jpg", "--k", "1") == b"0.9900  photos/bad-\xff.jpg\n"  # as ls has it
    # A stdout that is strict UTF-8 (print raised UnicodeEncodeError there; C.UTF-8's lets surrogates through)
    assert main([str(path), "--duplicates", "--threshold", "0.99"]) == 0
    assert capsysbinary.readouterr().out == ("0.9950  photos/c\x0cd\u2028e.jpg  photos/f\x85g.jpg\n".encode()
                                            + b"0.9900  photos/a.jpg  photos/bad-\xff.jpg\n")
    assert run(b"--like", b"bad-\xff.jpg", "--k", "1") == b"0.9900  photos/a.jpg\n"
    assert run("--like", "c\x0cd\u2028e.jpg", "--k", "1") == "0.9950  photos/f\x85g.jpg\n".encode()
    pairs = [json.loads(line) for line in run("--duplicates", "--json").decode("ascii").splitlines()]
    assert [(pair["a"], pair["b"]) for pair in pairs] == [("photos/c\x0cd\u2028e.jpg", "photos/f\x85g.jpg"),
                                                        ("photos/a.jpg", os.fsdecode(b"photos/bad-\xff.jpg"))]
