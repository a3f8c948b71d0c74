"""Near-duplicates and nearest neighbours among the embeddings ``python -m models.predict --embeddings`` wrote.

    .venv/bin/python -m models.neighbours runs/photos.npy --duplicates   # pairs at cosine >= 0.95, best first
    .venv/bin/python -m models.neighbours runs/photos.npy --duplicates --threshold 0.9 --json
    .venv/bin/python -m models.neighbours runs/photos.npy --like cat.jpg --k 5        # a name, or a unique end of one

It reads ``OUT.npy`` (float32, one row per image) and the names beside it, ``OUT.names.txt`` (one a line, in the
rows' order; runs/photos.npy's are runs/photos.names.txt). The similarity is the cosine of two rows: the model's
rows are unit vectors, and the similarities of other rows are divided by their lengths, so any vectors work. A row
of NaN or infinity compares with nothing: the file is refused, naming it. Names are printed as the names file holds
them (one that is not UTF-8 as its own bytes; in ``--json``, in JSON's ASCII escapes, which json reads back).

The search is exact and in numpy alone: ``--duplicates`` multiplies a block of rows by every row after the block's
first (the upper triangle: each pair once), keeps the similarities at or above the threshold and sorts them;
``--like`` is one matrix-vector product and ``np.argpartition``. Each block's similarities take at most
``BLOCK_BYTES`` whatever the number of rows, and at most ``MAX_PAIRS`` pairs are kept, so memory stays bounded: the
file is read through a memory map, never copied.

The time of ``--duplicates`` grows with the square of the rows. On the 2-core VM, for random unit vectors (the
commands in docs/models.md, "Embeddings in bulk"): 20,000 x 1,280 took 5.3 s, so 100,000 x 1,280 about 25 times
that; measured, 131 s, with 0.7 GB at most resident (0.5 GB of it the mapped file). A million rows would take about
100 times as long again (3.6 hours). ``--like`` reads the file once: 0.3 s at 20,000. Past a few hundred thousand
images, or to answer ``--like`` many times a second, a vector index takes over (FAISS, hnswlib, pgvector's HNSW
index): approximate, built once, a query in milliseconds.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from models.commands import python_command
from models.predict.outputs import names_file, read_meta, read_names

BLOCK_BYTES = 64 * 2**20  # the similarities of one block of rows against every row after its first: 64 MiB
MAX_PAIRS = 1_000_000  # --duplicates keeps at most this many pairs, the most similar (a low threshold, many images)
UNIT_TOLERANCE = 1e-4  # rows whose lengths are all within it of 1 are used as they are (the model's: L2-normalised)
DEFAULT_THRESHOLD = 0.95
# float32 rounding: a unit row's product with itself is 0.9999994, so --threshold 1 would miss exact duplicates;
# a pair within this of the threshold is at it
SIMILARITY_TOLERANCE = 1e-5
DEFAULT_K = 5


class NeighboursError(ValueError):
    """What was given cannot be read or answered: one line on stderr, exit code 2."""


@dataclass
class Embeddings:
    """The rows of an embeddings file (float32 or float64, read through a memory map), each row's length, whether
    every length is 1 (the model's rows: nothing to divide), and the rows' names."""

    rows: np.ndarray
    lengths: np.ndarray
    unit: bool
    names: list[str]


def read_embeddings(path: Path) -> Embeddings:
    """``path`` and the names beside it, checked: a 2-D array of finite numbers with one name per row."""
    if not path.is_file():
        raise NeighboursError(f"{path} does not exist: models.predict --embeddings {path} writes it")
    names_path = names_file(path)
    if not names_path.is_file():
        raise NeighboursError(f"{names_path} is missing: models.predict --embeddings {path} writes it beside {path}")
    try:
        rows = np.asarray(np.load(path, mmap_mode="r", allow_pickle=False))  # still the map: no copy
    except (ValueError, OSError) as exc:
        raise NeighboursError(f"{path} is not a .npy file numpy reads: {exc}") from None
    if rows.ndim != 2 or not np.issubdtype(rows.dtype, np.number) or np.issubdtype(rows.dtype, np.complexfloating):
        raise NeighboursError(f"{path} holds a {rows.dtype} array of shape {rows.shape}: expected one row of "
                              "numbers per image (N x dim)")
    if rows.dtype not in (np.float32, np.float64):
        rows = np.asarray(rows, dtype=np.float32)  # a copy: the products run in float32 or float64
    names = read_names(names_path)
    if len(names) != rows.shape[0]:
        raise NeighboursError(f"{path} holds {rows.shape[0]} rows and {names_path} {len(names)} names: they are "
                              "written together, one name per row; write them again with models.predict")
    lengths = np.ones(len(names), dtype=rows.dtype)
    for start, stop in _blocks(len(names), rows.shape[1], rows.itemsize):
        finite = np.isfinite(rows[start:stop]).all(axis=1)
        if not finite.all():  # NaN is similar to nothing and sorts anywhere: the image itself would be its neighbour
            bad = start + int(np.argmin(finite))
            raise NeighboursError(f"{path}: row {bad} ({_shown(names[bad])}) holds NaN or infinity, which no "
                                  "similarity compares: score that image again (models.predict writes no such row)")
        lengths[start:stop] = np.linalg.norm(rows[start:stop], axis=1)
    unit = bool(np.allclose(lengths, 1.0, atol=UNIT_TOLERANCE))
    lengths[lengths == 0] = 1.0  # a zero row is similar to nothing (0), not NaN
    return Embeddings(rows, lengths, unit, names)


def _blocks(count: int, width: int, itemsize: int) -> Iterator[tuple[int, int]]:
    """(start, stop) of consecutive blocks of ``count`` rows whose ``width`` values take at most BLOCK_BYTES."""
    size = max(1, BLOCK_BYTES // (itemsize * max(width, 1)))
    for start in range(0, count, size):
        yield start, min(count, start + size)


def duplicates(embeddings: Embeddings, threshold: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Every pair (i < j) whose cosine similarity is at least ``threshold``, most similar first (ties by i, then
    j): (similarities, i, j, how many pairs qualified); at most MAX_PAIRS of them are kept, the most similar."""
    rows, lengths, count = embeddings.rows, embeddings.lengths, len(embeddings.names)
    found: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    kept, qualified, floor = 0, 0, threshold
    for start, stop in _blocks(count, count, rows.itemsize):
        similarity = rows[start:stop] @ rows[start:].T  # the block against itself and every row after it
        if not embeddings.unit:
            similarity /= lengths[start:stop, None]
            similarity /= lengths[None, start:]
        similarity[:, : stop - start][np.tril_indices(stop - start)] = -np.inf  # each pair once, never itself
        above = similarity >= threshold - SIMILARITY_TOLERANCE
        qualified += int(np.count_nonzero(above))
        if floor > threshold:
            above &= similarity >= floor
        first, second = np.nonzero(above)
        found.append((similarity[first, second], first + start, second + start))
        kept += len(first)
        if kept > 2 * MAX_PAIRS:  # keep the best MAX_PAIRS; nothing below the worst of them can enter again
            found = [_best(*(np.concatenate(part) for part in zip(*found)), MAX_PAIRS)]
            kept, floor = MAX_PAIRS, float(found[0][0].min())
    if not found:
        return np.zeros(0, np.float32), np.zeros(0, np.int64), np.zeros(0, np.int64), 0
    similarities, first, second = (np.concatenate(part) for part in zip(*found))
    order = np.lexsort((second, first, -similarities))[:MAX_PAIRS]
    return similarities[order], first[order], second[order], qualified


def _best(similarities: np.ndarray, first: np.ndarray, second: np.ndarray,
          limit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ``limit`` most similar pairs, unordered."""
    if len(similarities) <= limit:
        return similarities, first, second
    chosen = np.argpartition(-similarities, limit - 1)[:limit]
    return similarities[chosen], first[chosen], second[chosen]


def like(embeddings: Embeddings, index: int, k: int) -> list[tuple[float, int]]:
    """The ``k`` rows most similar to row ``index`` (itself left out), most similar first (ties by row):
    (similarity, row)."""
    similarity = embeddings.rows @ embeddings.rows[index]
    if not embeddings.unit:
        similarity /= embeddings.lengths * embeddings.lengths[index]
    similarity[index] = -np.inf
    k = min(k, len(similarity) - 1)
    if k <= 0:
        return []
    nearest = np.argpartition(-similarity, k - 1)[:k]
    nearest = nearest[np.lexsort((nearest, -similarity[nearest]))]
    return [(float(similarity[j]), int(j)) for j in nearest]


def find_name(names: Sequence[str], wanted: str) -> int:
    """The row of ``wanted``: a name as written in the names file, or the one name that ends with it after a
    ``/`` (its base name, or more of its path); NeighboursError when none or several do."""
    exact = [i for i, name in enumerate(names) if name == wanted]
    if exact:
        return exact[0]
    tail = "/" + wanted.lstrip("/")
    matches = [i for i, name in enumerate(names) if name.replace("\\", "/").endswith(tail)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise NeighboursError(f"--like {wanted}: no name in the names file is or ends with it "
                              f"({len(names)} names, e.g. {_shown(names[0]) if names else 'none'})")
    more = f" and {len(matches) - 3} more" if len(matches) > 3 else ""
    shown = ", ".join(_shown(names[i]) for i in matches[:3]) + more
    raise NeighboursError(f"--like {wanted} ends {len(matches)} names ({shown}): give more of its path")


def _similarity(value: float) -> float:
    """A similarity as printed: within [-1, 1] (float32 rounding can pass 1 for equal rows)."""
    return min(1.0, max(-1.0, float(value)))


def _shown(name: str) -> str:
    """A name in a line of text: one that is not UTF-8 (surrogate escapes) with its bytes as \\xff."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _out(lines: Iterator[str]) -> None:
    """``lines`` on stdout, each name as the names file holds it: one that is not UTF-8 as its own bytes (print
    would raise UnicodeEncodeError for its surrogate escapes); JSON lines are ASCII already."""
    buffer = getattr(sys.stdout, "buffer", None)
    sys.stdout.flush()
    for line in lines:
        if buffer is None:  # a stdout of text alone (an embedding program's): the bytes shown as \xff
            print(_shown(line))
        else:
            buffer.write(line.encode("utf-8", "surrogateescape") + b"\n")
    sys.stdout.flush()


def _made_by(path: Path) -> str:
    """Which model's embeddings ``path`` holds, as its meta file says: " (mine 1's embeddings)", or nothing."""
    meta = read_meta(path)
    if meta is None or not isinstance(meta.get("model"), str):
        return ""
    return f" ({meta['model']} {meta.get('version')}'s embeddings)"


def print_duplicates(embeddings: Embeddings, threshold: float, as_json: bool, made_by: str = "") -> None:
    """``similarity  name_a  name_b`` lines (or JSON lines) on stdout; how many on stderr (and ``made_by``: whose
    embeddings)."""
    similarities, first, second, qualified = duplicates(embeddings, threshold)
    names = embeddings.names
    _out(json.dumps({"similarity": round(_similarity(value), 6), "a": names[i], "b": names[j]}) if as_json
         else f"{_similarity(value):.4f}  {names[i]}  {names[j]}"
         for value, i, j in zip(similarities.tolist(), first.tolist(), second.tolist()))
    shown = f" (the {len(similarities)} most similar shown: raise --threshold)" if qualified > len(similarities) else ""
    print(f"{qualified} pairs at cosine similarity >= {threshold} among {len(names)} images{made_by}{shown}",
          file=sys.stderr)


def print_like(embeddings: Embeddings, wanted: str, k: int, as_json: bool) -> None:
    """``similarity  name`` lines (or JSON lines) on stdout: the neighbours of ``wanted``, most similar first."""
    nearest = like(embeddings, find_name(embeddings.names, wanted), k)
    _out(json.dumps({"similarity": round(_similarity(value), 6), "name": embeddings.names[j]}) if as_json
         else f"{_similarity(value):.4f}  {embeddings.names[j]}" for value, j in nearest)


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"{python_command()} -m models.neighbours", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("embeddings", type=Path, help="OUT.npy of models.predict --embeddings (OUT.names.txt beside)")
    task = parser.add_mutually_exclusive_group(required=True)
    task.add_argument("--duplicates", action="store_true",
                      help="every pair at or above --threshold, most similar first: similarity  name_a  name_b")
    task.add_argument("--like", metavar="NAME",
                      help="the --k nearest neighbours of NAME (as in the names file, or a unique end of it after "
                           "a /, such as its base name), itself left out: similarity  name")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                        help=f"--duplicates: the least cosine similarity, -1 to 1 (default {DEFAULT_THRESHOLD})")
    parser.add_argument("--k", type=int, default=DEFAULT_K, help=f"--like: neighbours shown (default {DEFAULT_K})")
    parser.add_argument("--json", action="store_true", help="JSON lines instead: {similarity, a, b} or "
                                                             "{similarity, name}")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for ``python -m models.neighbours``; returns the exit code (2: one line saying what is wrong)."""
    args = get_args_parser().parse_args(argv)
    try:
        if not -1.0 <= args.threshold <= 1.0:
            raise NeighboursError(f"--threshold {args.threshold}: a cosine similarity is between -1 and 1")
        if args.k < 1:
            raise NeighboursError(f"--k {args.k}: ask for at least 1 neighbour")
        embeddings = read_embeddings(args.embeddings)
        if args.duplicates:
            print_duplicates(embeddings, args.threshold, args.json, _made_by(args.embeddings))
        else:
            print_like(embeddings, args.like, args.k, args.json)
    except NeighboursError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
