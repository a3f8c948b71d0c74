"""The records: one per input, ``{"path", "labels", "scores", "model", "version"}`` (top-k, best first) or
``{"path", "error", "model", "version"}`` for a file that cannot be scored; with ``--embeddings``, each scored
image's embedding too.

Each rank appends its records to its own part file (``OUT.parts/rank-NNNNN.jsonl``), flushed after every batch, so a
stopped run loses at most a batch per rank: a rerun reads the merged file and every part, and skips what they hold.
When every rank is done, rank 0 merges them into ``OUT`` in input order (JSON lines, CSV or Parquet by extension),
written to a temporary file and renamed, and removes the parts.

Embeddings ride on the same parts: each rank appends its batch's rows (raw float32, ``dim`` values a row) to
``OUT.parts/rank-NNNNN.embeddings-<dim>.f32`` and flushes them before the batch's records, each of which names its
row (``embedding_row``, ``embedding_dim``: part files only), so a record never points past what is written and a
half-written row is cut before appending. A rerun skips an image only when its embedding is written too (in the
parts, or in the merged ``EMB.npy`` with its ``EMB.names.txt``). The merge writes ``EMB.npy`` (N x dim float32, one
row per scored image, in the records' order; an image that could not be scored has none) and ``EMB.names.txt`` (its
path, one a line, in the same order: split it on "\\n" alone, as ``read_names`` does; a name may hold characters
``str.splitlines()`` also splits at), each to a temporary file and renamed, before ``OUT`` and the parts' removal,
and last ``EMB.meta.json``: the model, version and ``OUT`` the rows are of. A rerun keeps the merged rows only when
that matches it (another run's ``EMB.npy``, or one without it, is scored again).
"""
from __future__ import annotations

import csv
import fcntl
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterable, Iterator, Sequence

import numpy as np

from models.commands import python_command
from models.run.args import DataError

Record = dict[str, Any]
FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet"}  # .json is one document
EMBEDDINGS_SUFFIX = ".npy"
NAMES_SUFFIX = ".names.txt"  # the names beside an embeddings file: runs/photos.npy's are runs/photos.names.txt
META_SUFFIX = ".meta.json"  # what the rows of an embeddings file are of: runs/photos.npy's is runs/photos.meta.json
EMBEDDING_ROW = "embedding_row"  # a part record's row in its rank's embeddings part (never in OUT)
EMBEDDING_DIM = "embedding_dim"  # that row's length, which names the part it is in
PART_KEYS = (EMBEDDING_ROW, EMBEDDING_DIM)
ROW_DTYPE = np.dtype("<f4")  # the parts' rows and the merged file's: float32
MERGE_ROWS = 4096  # rows the merge copies at once into the merged file (20 MB at 1,280 values)
# Line ends str.splitlines() knows that json.dumps leaves raw (it escapes those below U+0020): json_line escapes them
LINE_ENDS_ESCAPED = {ord(c): f"\\u{ord(c):04x}" for c in "\u0085\u2028\u2029"}


def output_format(out: Path) -> str:
    """jsonl, csv or parquet from ``--out``'s extension; DataError for another, or for Parquet without pyarrow."""
    fmt = FORMATS.get(out.suffix.lower())
    if fmt is None:
        hint = (": a .json file is one JSON document, and this tool writes JSON Lines, one record a line"
                if out.suffix.lower() == ".json" else "")
        raise DataError(f"--out {out}: write .jsonl, .csv or .parquet (JSON Lines also as .ndjson){hint}")
    if fmt == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise DataError(f"writing .parquet needs pyarrow, which is not installed: `{python_command()} -m pip "
                            "install pyarrow`, or write .jsonl or .csv") from None
    return fmt


def json_line(record: Record) -> str:
    """One record as a line of JSON: UTF-8 as it reads, but for a path that is not UTF-8 (os.walk gives its bytes as
    surrogate escapes, which UTF-8 cannot encode): its record in ASCII escapes (\\udcff), which json reads back to
    the same path, so the file is written, the others scored, and a rerun still skips it."""
    line = json.dumps(record, ensure_ascii=False)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        line = json.dumps(record)
    # U+2028, U+2029 and U+0085 in a file name would be written raw, and str.splitlines() (what many readers split a
    # file with) ends a line at each: escaped, the line is one line to every reader (json writes them inside strings
    # alone, where the escape reads back the same).
    return line.translate(LINE_ENDS_ESCAPED) + "\n"


def check_parquet_names(paths: Iterable[str], out: Path) -> None:
    """DataError (before the model loads) naming the first path Parquet cannot hold: its strings are UTF-8, and a
    file name that is not (os.walk's surrogate escapes) has no lossless form there, as it has in .jsonl and .csv."""
    for path in paths:
        try:
            path.encode("utf-8")
        except UnicodeEncodeError:
            shown = path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            raise DataError(f"--out {out}: the input {shown} has a name that is not UTF-8, which Parquet cannot "
                            "hold: write .jsonl or .csv (they keep it), or rename the file") from None


def hold_output(out: Path) -> IO[str]:
    """An exclusive hold on writing ``out`` (its parts, embeddings and merge) for as long as the returned file stays
    open: DataError when another run holds it. Two runs on one ``--out`` at once each appended to the same parts,
    each numbering embedding rows from its own count: most images got another's embedding, and both said they
    wrote them all (a new user's double launch)."""
    lock = out.with_name(f".{out.name}.lock")
    handle = lock.open("a+", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise DataError(f"another run writes {out} now ({holder}): wait for it to end, or give this one another "
                        f"--out") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}")
    handle.flush()
    return handle


def parts_dir(out: Path) -> Path:
    """Where the ranks' part files of ``out`` live until the merge."""
    return out.with_name(out.name + ".parts")


def part_file(out: Path, rank: int) -> Path:
    """One rank's part file."""
    return parts_dir(out) / f"rank-{rank:05d}.jsonl"


def embeddings_part(part: Path, dim: int) -> Path:
    """The embeddings beside a part file: rank-00000.jsonl's rows of 1280 values are rank-00000.embeddings-1280.f32."""
    return part.with_name(f"{part.stem}.embeddings-{dim}.f32")


def names_file(embeddings: Path) -> Path:
    """The names beside an embeddings file: runs/photos.npy's are runs/photos.names.txt."""
    return embeddings.with_suffix(NAMES_SUFFIX)


def meta_file(embeddings: Path) -> Path:
    """What an embeddings file's rows are of, beside it: runs/photos.npy's is runs/photos.meta.json."""
    return embeddings.with_suffix(META_SUFFIX)


def read_names(path: Path) -> list[str]:
    """A names file's names: split on "\\n" alone (a file name may hold a form feed, U+2028 or another character
    ``str.splitlines()`` splits at; models.predict refuses only a name with "\\n" or "\\r"), a name that is not UTF-8
    read back from its own bytes (surrogate escapes), as ``write_embeddings`` wrote it."""
    names = path.read_bytes().decode("utf-8", "surrogateescape").split("\n")
    if names[-1] == "":
        names.pop()  # the last name's line end
    return names


def embeddings_meta(out: Path, embeddings: Path, identity: dict[str, str], dim: int) -> dict[str, Any]:
    """What the merge writes into ``meta_file(embeddings)``: the model and version whose rows they are (this run's
    ``identity``), their length, and the ``--out`` they were merged with, relative to the embeddings' folder (so the
    two may move together, and a run from another folder names the same file)."""
    return {"model": identity["model"], "version": identity["version"], "dim": dim,
            "out": os.path.relpath(os.path.abspath(out), os.path.abspath(embeddings.parent))}


def read_meta(embeddings: Path) -> dict[str, Any] | None:
    """``meta_file(embeddings)`` as written, or None when it is missing or cannot be read as a JSON object."""
    try:
        meta = json.loads(meta_file(embeddings).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def merged_refusal(out: Path, embeddings: Path, dim: int, identity: dict[str, str] | None) -> str | None:
    """Why the rows of a merged ``embeddings`` are not this run's to keep (None: they are, or there is no such file):
    a file without its meta file (written before there was one, or a merge cut short: it is removed first and
    written last), or whose meta file names another model, version, row length or ``--out``. Such rows may be of
    other images at the same paths (another --out's data) or of another model: the images are scored again."""
    if not embeddings.is_file():
        return None
    meta = read_meta(embeddings)
    if meta is None:
        return f"no {meta_file(embeddings).name} beside it names the model and --out its rows are of"
    if identity is None:
        return "this run's model is not known yet"
    wanted = embeddings_meta(out, embeddings, identity, dim)
    if (meta.get("model"), meta.get("version")) != (wanted["model"], wanted["version"]):
        return f"its rows are of {meta.get('model')} {meta.get('version')}, not {wanted['model']} {wanted['version']}"
    if meta.get("dim") != dim:
        return f"its rows are of {meta.get('dim')} values, not {dim}"
    if meta.get("out") != wanted["out"]:
        return f"merged with another --out: {meta.get('out')}, relative to its folder"
    return None


def npy_shape(path: Path) -> tuple[int, ...] | None:
    """The shape of the array a .npy file holds (the file mapped, not read), or None when it is no such file."""
    try:
        return tuple(np.load(path, mmap_mode="r", allow_pickle=False).shape)
    except (OSError, ValueError):
        return None


def _whole_rows(path: Path, dim: int) -> int:
    """The whole rows of ``dim`` values an embeddings part holds (a half-written last one left out)."""
    return path.stat().st_size // (dim * ROW_DTYPE.itemsize) if path.is_file() else 0


def repair_tail(path: Path) -> None:
    """Cut a line a stopped run left half-written, so appending starts on a fresh line."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("r+b") as handle:
            handle.truncate(data.rfind(b"\n") + 1)


def _read_jsonl(path: Path) -> Iterator[Record]:
    # Lines end at "\n" alone: str.splitlines() also splits at U+2028, U+2029 and U+0085, which a file name may hold
    # and runs before json_line escaped them wrote raw: its record was dropped, and scored again, on every rerun.
    # "replace": a half-written last line may end inside a character.
    for line in path.read_bytes().decode("utf-8", "replace").split("\n"):
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a half-written last line of a stopped run
        if isinstance(record, dict) and "path" in record:
            yield record


def _read_csv(path: Path) -> Iterator[Record]:
    with path.open(newline="", encoding="utf-8", errors="surrogateescape") as handle:  # as _write_csv wrote names
        for row in csv.DictReader(handle):
            yield _from_flat(row)


def _read_parquet(path: Path) -> Iterator[Record]:
    import pyarrow.parquet as pq

    for row in pq.read_table(path).to_pylist():
        yield _from_flat(row)


def read_records(out: Path, fmt: str) -> list[Record]:
    """What earlier runs wrote: the merged file, then every part file (a later record of a path wins)."""
    records: list[Record] = []
    if out.is_file():
        records += {"jsonl": _read_jsonl, "csv": _read_csv, "parquet": _read_parquet}[fmt](out)
    for part in sorted(parts_dir(out).glob("rank-*.jsonl")):
        records += _read_jsonl(part)
    return records


def check_same_model(records: Iterable[Record], out: Path, identity: dict[str, str], repository: bool = True) -> None:
    """DataError when ``out`` or its parts hold answers of another model or version than ``identity`` (this run's
    ``{"model", "version"}``): a rerun would write one file of two models' answers (a new version exported since).
    ``repository``: whether the weights are a model repository, where --version chooses the version that wrote
    them (one export holds one version)."""
    kept = {(record.get("model"), record.get("version")) for record in records}
    other = sorted(f"{model} {version}" for model, version in kept - {(identity["model"], identity["version"])})
    if other:
        raise DataError(f"{out} holds answers of {', '.join(other)}, not of {identity['model']} "
                        f"{identity['version']}, which this run loads: "
                        + ("go on with the weights that wrote them (--version), " if repository else "")
                        + f"write to another --out, or remove {out} and {parts_dir(out)} to start afresh")


def check_same_top_k(records: Iterable[Record], out: Path, top_k: int) -> None:
    """DataError when ``out`` or its parts hold answers of another ``--top-k`` than this run's: a resume would
    write rows of two widths into one file (a CSV's later rows padded empty)."""
    kept = sorted({len(r["labels"]) for r in records if not r.get("error") and r.get("labels")} - {top_k})
    if kept:
        raise DataError(f"--top-k {top_k}, but {out} holds answers of --top-k {', '.join(map(str, kept))}: go on with "
                        f"that --top-k, write to another --out, or remove {out} and {parts_dir(out)} to start afresh")


OPTIONS_NAME = "options.json"  # in the parts folder: how an unfinished run scored, for its resume to score alike


def check_same_options(out: Path, options: dict[str, str]) -> None:
    """DataError when the unfinished run whose parts ``out`` has scored with other ``options`` (the weights'
    format, dtype, decode path): a resume would write one file of two configurations' answers, no row saying which;
    else the options are kept in its parts for the next resume."""
    kept_at = parts_dir(out) / OPTIONS_NAME
    try:
        kept = json.loads(kept_at.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        kept = None
    if isinstance(kept, dict) and any(part.is_file() for part in parts_dir(out).glob("rank-*.jsonl")):
        changed = [f"{name} {kept[name]} then, {value} now" for name, value in options.items()
                   if name in kept and kept[name] != value]
        if changed:
            raise DataError(f"the run that wrote {parts_dir(out)} scored otherwise ({'; '.join(changed)}): go on as it "
                            f"did, write to another --out, or remove {out} and {parts_dir(out)} to start afresh")
    parts_dir(out).mkdir(parents=True, exist_ok=True)
    kept_at.write_text(json.dumps(options, sort_keys=True), encoding="utf-8")


def done_paths(records: Iterable[Record], retry_errors: bool = False, embedded: set[str] | None = None) -> set[str]:
    """The paths a rerun skips (with ``retry_errors``, not those that failed). With ``embedded`` (the paths whose
    embedding is written), a path whose newest record was scored is skipped only when it is among them."""
    records = list(records)
    skipped = {r["path"] for r in records if not (retry_errors and r.get("error"))}
    if embedded is None:
        return skipped
    failed = {r["path"]: bool(r.get("error")) for r in records}  # the newest record of each path decides
    return {path for path in skipped if failed[path] or path in embedded}


@dataclass(frozen=True)
class StoredRow:
    """Where one image's embedding is written: the merged .npy or a rank's embeddings part, and its row there."""

    file: Path
    row: int


def stored_embeddings(out: Path, embeddings: Path, dim: int,
                      identity: dict[str, str] | None) -> dict[str, StoredRow]:
    """Each path's written embedding of ``dim`` values (a later one wins): the merged file's rows, by its names file
    (unless its meta file says they are not of this ``identity`` and ``out``, merged_refusal, or the names and rows
    disagree: then none), then every part's."""
    stored: dict[str, StoredRow] = {}
    names = names_file(embeddings)
    if names.is_file() and embeddings.is_file() and merged_refusal(out, embeddings, dim, identity) is None:
        listed = read_names(names)
        if npy_shape(embeddings) == (len(listed), dim):
            stored.update((name, StoredRow(embeddings, row)) for row, name in enumerate(listed))
    for part in sorted(parts_dir(out).glob("rank-*.jsonl")):
        rows = embeddings_part(part, dim)
        whole = _whole_rows(rows, dim)
        for record in _read_jsonl(part):
            row = record.get(EMBEDDING_ROW)
            if record.get(EMBEDDING_DIM) == dim and isinstance(row, int) and 0 <= row < whole:
                stored[record["path"]] = StoredRow(rows, row)
    return stored


class PartWriter:
    """One rank's part file, appended and flushed per batch; with ``dim``, its embeddings part beside it, whose rows
    are flushed before the records that name them."""

    def __init__(self, path: Path, dim: int | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.handle = path.open("a", encoding="utf-8")
        self.dim, self.rows, self.next_row = dim, None, 0
        if dim is not None:
            rows = embeddings_part(path, dim)
            self.next_row = _whole_rows(rows, dim)
            if rows.is_file():
                os.truncate(rows, self.next_row * dim * ROW_DTYPE.itemsize)  # a half-written row cut
            self.rows = rows.open("ab")

    def write(self, records: Iterable[Record], embeddings: Sequence[np.ndarray | None] | None = None) -> None:
        """Append ``records``; with ``embeddings`` (one per record: its vector, or None), their rows first."""
        records = list(records)
        if self.rows is not None and embeddings is not None:
            present = [(r, vector) for r, vector in zip(records, embeddings, strict=True) if vector is not None]
            if present:
                self.rows.write(np.stack([vector for _, vector in present]).astype(ROW_DTYPE).tobytes())
                self.rows.flush()
                for record, _ in present:
                    record |= {EMBEDDING_ROW: self.next_row, EMBEDDING_DIM: self.dim}
                    self.next_row += 1
        self.handle.write("".join(json_line(r) for r in records))
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()
        if self.rows is not None:
            self.rows.close()


def merged_records(out: Path, fmt: str, order: dict[str, int]) -> list[Record]:
    """Every record of ``out`` and its parts, one per path (the newest), in input order (paths no longer in the
    input after them, in the order they were written)."""
    latest: dict[str, Record] = {}
    for record in read_records(out, fmt):
        latest.pop(record["path"], None)
        latest[record["path"]] = record
    tail = len(order)
    return sorted(latest.values(), key=lambda r: order.get(r["path"], tail))


def write_embeddings(records: Sequence[Record], out: Path, embeddings: Path, dim: int,
                     identity: dict[str, str]) -> int:
    """``embeddings`` (N x dim float32), its names file and its meta file (``identity``'s rows, merged with ``out``):
    the written embedding of every scored record, in the records' order, each file written to a temporary file and
    renamed (before the parts, which it reads, go); returns N. A scored record without one (never, after a run with
    --embeddings) has no row. The meta file is removed first and written last: rows a merge cut short left are never
    taken for a run's (merged_refusal)."""
    stored = stored_embeddings(out, embeddings, dim, identity)
    names = [r["path"] for r in records if not r.get("error") and r["path"] in stored]
    embeddings.parent.mkdir(parents=True, exist_ok=True)
    temporary = embeddings.with_name(f".{embeddings.name}.{os.getpid()}.tmp")
    names_temporary, meta_temporary = (temporary.with_name(temporary.name + s) for s in (NAMES_SUFFIX, META_SUFFIX))
    try:
        _write_rows(temporary, names, stored, dim)
        # a name that is not UTF-8 as its own bytes, as the file system has it (read back alike by stored_embeddings)
        names_temporary.write_text("".join(name + "\n" for name in names), encoding="utf-8", errors="surrogateescape")
        meta_temporary.write_text(json.dumps(embeddings_meta(out, embeddings, identity, dim)) + "\n", encoding="utf-8")
    except BaseException:  # a full disk, Ctrl-C: no temporary file left behind (a run's embeddings: gigabytes)
        for left in (temporary, names_temporary, meta_temporary):
            left.unlink(missing_ok=True)
        raise
    meta_file(embeddings).unlink(missing_ok=True)
    os.replace(temporary, embeddings)
    os.replace(names_temporary, names_file(embeddings))
    os.replace(meta_temporary, meta_file(embeddings))
    return len(names)


def _write_rows(temporary: Path, names: list[str], stored: dict[str, StoredRow], dim: int) -> None:
    """The rows of ``names`` into ``temporary`` (a .npy), its blocks taken before a row is written: a full disk is
    an OSError here, where writing into a memory map of a sparse file died of SIGBUS with nothing said."""
    matrix = np.lib.format.open_memmap(temporary, mode="w+", dtype=ROW_DTYPE, shape=(len(names), dim))
    with temporary.open("r+b") as file:
        size = os.fstat(file.fileno()).st_size
        if size:
            os.posix_fallocate(file.fileno(), 0, size)
    sources = {file: _rows_of(file, dim) for file in {stored[name].file for name in names}}
    for start in range(0, len(names), MERGE_ROWS):
        by_file: dict[Path, tuple[list[int], list[int]]] = {}
        for position, name in enumerate(names[start:start + MERGE_ROWS], start):
            targets, rows = by_file.setdefault(stored[name].file, ([], []))
            targets.append(position)
            rows.append(stored[name].row)
        for file, (targets, rows) in by_file.items():
            matrix[targets] = sources[file][rows]
    matrix.flush()
    del matrix, sources


def _rows_of(file: Path, dim: int) -> np.ndarray:
    """The rows of the merged .npy or of an embeddings part (whole rows only), read through a memory map."""
    if file.suffix == EMBEDDINGS_SUFFIX:
        return np.load(file, mmap_mode="r", allow_pickle=False)
    return np.memmap(file, dtype=ROW_DTYPE, mode="r", shape=(_whole_rows(file, dim), dim))


def write_merged(out: Path, fmt: str, records: Sequence[Record]) -> list[Record]:
    """``records``, less the keys only part files hold, into ``out`` (rewritten atomically); the parts removed."""
    records = [{key: value for key, value in r.items() if key not in PART_KEYS} for r in records]
    temporary = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    {"jsonl": _write_jsonl, "csv": _write_csv, "parquet": _write_parquet}[fmt](records, temporary)
    os.replace(temporary, out)
    shutil.rmtree(parts_dir(out), ignore_errors=True)
    return records


def merge(out: Path, fmt: str, order: dict[str, int]) -> list[Record]:
    """Every record of ``out`` and its parts, one per path (the newest), in input order (paths no longer in the
    input after them, in the order they were written); ``out`` rewritten atomically, the parts removed."""
    return write_merged(out, fmt, merged_records(out, fmt, order))


def _write_jsonl(records: list[Record], path: Path) -> None:
    with path.open("w", encoding="utf-8") as handle:
        handle.writelines(json_line(r) for r in records)


def _top_k(records: list[Record]) -> int:
    return max((len(r.get("labels") or ()) for r in records), default=0)


def _flat(record: Record, k: int) -> dict[str, Any]:
    """A record as one table row: path, label_1, score_1, ... label_k, score_k, model, version, error."""
    row: dict[str, Any] = {"path": record["path"]}
    labels, scores = record.get("labels") or [], record.get("scores") or []
    for i in range(k):
        row[f"label_{i + 1}"] = labels[i] if i < len(labels) else None
        row[f"score_{i + 1}"] = scores[i] if i < len(scores) else None
    return row | {"model": record.get("model"), "version": record.get("version"), "error": record.get("error")}


def _from_flat(row: dict[str, Any]) -> Record:
    labels, scores, i = [], [], 1
    while f"label_{i}" in row:
        if row[f"label_{i}"] not in (None, ""):
            labels.append(row[f"label_{i}"])
            scores.append(float(row[f"score_{i}"]))
        i += 1
    record: Record = {"path": row["path"]}
    if row.get("error"):
        record["error"] = row["error"]
    else:
        record |= {"labels": labels, "scores": scores}
    return record | {"model": row.get("model"), "version": row.get("version")}


def _write_csv(records: list[Record], path: Path) -> None:
    k = _top_k(records)
    # a path that is not UTF-8 is written as its own bytes, as the file system has it (a surrogate escape cannot be
    # encoded): lossless, as ls shows it, and _read_csv reads it back to the same path
    with path.open("w", newline="", encoding="utf-8", errors="surrogateescape") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(_flat({"path": ""}, k)))
        writer.writeheader()
        writer.writerows({key: ("" if value is None else repr(value) if isinstance(value, float) else value)
                          for key, value in _flat(r, k).items()} for r in records)


def _write_parquet(records: list[Record], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    k = _top_k(records)
    pq.write_table(pa.Table.from_pylist([_flat(r, k) for r in records]), path)
