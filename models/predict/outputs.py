"""The records: one per input, ``{"path", "labels", "scores", "model", "version"}`` (top-k, best first) or
``{"path", "error", "model", "version"}`` for a file that cannot be scored.

Each rank appends its records to its own part file (``OUT.parts/rank-NNNNN.jsonl``), flushed after every batch, so a
stopped run loses at most a batch per rank: a rerun reads the merged file and every part, and skips what they hold.
When every rank is done, rank 0 merges them into ``OUT`` in input order (JSON lines, CSV or Parquet by extension),
written to a temporary file and renamed, and removes the parts.
"""
from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable, Iterator

from models.run.args import DataError

Record = dict[str, Any]
FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet"}


def output_format(out: Path) -> str:
    """jsonl, csv or parquet from ``--out``'s extension; DataError for another, or for Parquet without pyarrow."""
    fmt = FORMATS.get(out.suffix.lower())
    if fmt is None:
        raise DataError(f"--out {out}: write .jsonl, .csv or .parquet")
    if fmt == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise DataError("writing .parquet needs pyarrow, which is not installed: `pip install pyarrow`, "
                            "or write .jsonl or .csv") from None
    return fmt


def parts_dir(out: Path) -> Path:
    """Where the ranks' part files of ``out`` live until the merge."""
    return out.with_name(out.name + ".parts")


def part_file(out: Path, rank: int) -> Path:
    """One rank's part file."""
    return parts_dir(out) / f"rank-{rank:05d}.jsonl"


def repair_tail(path: Path) -> None:
    """Cut a line a stopped run left half-written, so appending starts on a fresh line."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("r+b") as handle:
            handle.truncate(data.rfind(b"\n") + 1)


def _read_jsonl(path: Path) -> Iterator[Record]:
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a half-written last line of a stopped run
        if isinstance(record, dict) and "path" in record:
            yield record


def _read_csv(path: Path) -> Iterator[Record]:
    with path.open(newline="", encoding="utf-8") as handle:
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


def done_paths(records: Iterable[Record], retry_errors: bool = False) -> set[str]:
    """The paths a rerun skips (with ``retry_errors``, not those that failed)."""
    return {r["path"] for r in records if not (retry_errors and r.get("error"))}


class PartWriter:
    """One rank's part file, appended and flushed per batch."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.handle = path.open("a", encoding="utf-8")

    def write(self, records: Iterable[Record]) -> None:
        self.handle.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


def merge(out: Path, fmt: str, order: dict[str, int]) -> list[Record]:
    """Every record of ``out`` and its parts, one per path (the newest), in input order (paths no longer in the
    input after them, in the order they were written); ``out`` rewritten atomically, the parts removed."""
    latest: dict[str, Record] = {}
    for record in read_records(out, fmt):
        latest.pop(record["path"], None)
        latest[record["path"]] = record
    tail = len(order)
    records = sorted(latest.values(), key=lambda r: order.get(r["path"], tail))
    temporary = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    {"jsonl": _write_jsonl, "csv": _write_csv, "parquet": _write_parquet}[fmt](records, temporary)
    os.replace(temporary, out)
    shutil.rmtree(parts_dir(out), ignore_errors=True)
    return records


def _write_jsonl(records: list[Record], path: Path) -> None:
    with path.open("w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


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
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(_flat({"path": ""}, k)))
        writer.writeheader()
        writer.writerows({key: ("" if value is None else repr(value) if isinstance(value, float) else value)
                          for key, value in _flat(r, k).items()} for r in records)


def _write_parquet(records: list[Record], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    k = _top_k(records)
    pq.write_table(pa.Table.from_pylist([_flat(r, k) for r in records]), path)
