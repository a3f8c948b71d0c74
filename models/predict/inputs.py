"""What to score: every file under a folder (sorted, hidden ones left out) or the files a list names, each rank's
share of them, and, to evaluate, each file's true class (its folder under DIR/<class>/, or a CSV of path,label)."""
from __future__ import annotations

import collections
import csv
import io
import operator
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from models.run.args import DataError


@dataclass(frozen=True)
class Item:
    """One input: ``path`` as the output names it (the folder joined with the file's path in it, or the list's line
    as written), ``file`` where it is read from."""

    path: str
    file: str


def scan_folder(root: Path) -> list[Item]:
    """Every regular file under ``root`` in sorted order (hidden files and folders left out; links to folders
    followed, as training follows them: ``folder_files``): the same order every run. A named pipe, socket or device
    is left out: reading a pipe waits for a writer that never comes, and the run with it. A link that leads nowhere
    stays, so its record says why it cannot be read."""
    return [Item(entry.path, entry.path) for _, _, files in folder_files(str(root)) for entry in files
            if _regular_or_unreadable(entry.path)]


def folder_files(root: str, links: bool = True) -> Iterator[tuple[str, str, list[os.DirEntry[str]]]]:
    """Each folder under ``root``, ``root`` first, as (its path as reached, its real path, its files' entries by
    name), each folder before those in it and these by name; hidden files and folders left out. With ``links``, a
    link to a folder directly in ``root`` is followed (``DIR/<class>`` linked from elsewhere, which training reads:
    before, models.predict left its images out, a data scientist's trial), unless it leads to ``root`` or a folder
    above it; a link to a folder further down is not (as training reads a class folder: it could lead back to a
    folder read already, another class's, or far outside). A folder that cannot be read is passed over, as os.walk
    passes it."""
    top = os.path.realpath(root)
    stack = [(root, 0)]
    while stack:
        folder, depth = stack.pop()
        try:
            with os.scandir(folder) as listing:
                entries = sorted((entry for entry in listing if not entry.name.startswith(".")), key=_NAME)
        except OSError:
            continue
        kinds = [_folder(entry) for entry in entries]
        yield folder, os.path.realpath(folder), [entry for entry, is_folder in zip(entries, kinds) if not is_folder]
        stack.extend((entry.path, depth + 1) for entry, is_folder in zip(reversed(entries), reversed(kinds))
                     if is_folder and (not entry.is_symlink() or (links and depth == 0 and _below(entry.path, top))))


def _below(link: str, top: str) -> bool:
    """Whether ``link`` leads to a folder that is neither ``top`` nor above it."""
    real = os.path.realpath(link)
    return real != top and not top.startswith(os.path.join(real, ""))


_NAME = operator.attrgetter("name")


def _folder(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()  # (a link to a folder too)
    except OSError:
        return False


def _regular_or_unreadable(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return True


def utf8_text(path: Path, option: str) -> str:
    """``path``'s text; DataError naming the file and the line when it is not UTF-8 (a traceback before)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise DataError(f"{option} {path}: line {line} is not UTF-8 text (byte 0x{data[exc.start]:02x}): save it as "
                        "UTF-8") from None


def read_list(list_file: Path) -> list[Item]:
    """The files a list names, one per line (blank lines and ``#`` comments skipped); a relative path is relative
    to the list's folder. A list must be UTF-8 (DataError naming the line that is not). Lines end at ``\n`` alone
    (a ``\r`` before it dropped), as the names files this command writes are read: a name may hold any other
    character (U+2028, a form feed, U+0085 split a name in two before), and only ASCII spaces and tabs around a
    name are taken off (a no-break space is part of it)."""
    items = []
    for line in utf8_text(list_file, "--data").split("\n"):
        name = line.removesuffix("\r").strip(" \t")
        if name and not name.startswith("#"):
            items.append(Item(name, name if os.path.isabs(name) else os.path.join(list_file.parent, name)))
    return items


# how the files of the formats the server takes begin (a file list is text: none of these)
IMAGE_SIGNATURES = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a")
# a BMP's "BM" is followed by its file header; its info header's size (bytes 14-17) is one of these
BMP_INFO_HEADER_SIZES = (12, 16, 40, 52, 56, 64, 108, 124)


def is_image_file(path: Path) -> bool:
    """Whether ``path`` begins as a JPEG, PNG, GIF, BMP or WebP does (a list whose first line starts with ``BM``
    or ``RIFF`` is still a list)."""
    with path.open("rb") as file:
        head = file.read(18)
    if head.startswith(b"BM"):
        return len(head) == 18 and int.from_bytes(head[14:18], "little") in BMP_INFO_HEADER_SIZES
    if head.startswith(b"RIFF"):
        return head[8:12] == b"WEBP"
    return head.startswith(IMAGE_SIGNATURES)


def list_inputs(data: Path) -> list[Item]:
    """``--data``: a folder, a file list or one image; DataError when it is none of them, or names no file."""
    if data.is_dir():
        items = scan_folder(data)
    elif data.is_file() and is_image_file(data):
        items = [Item(str(data), str(data))]
    elif data.is_file():
        items = read_list(data)
    elif not data.exists():
        raise DataError(f"--data {data} does not exist")
    else:
        raise DataError(f"--data {data} is neither a folder nor a file list")
    if not items:
        empty = data.is_file() and data.stat().st_size == 0
        raise DataError(f"--data {data} is empty (0 bytes): neither an image nor a list of files" if empty
                        else f"--data {data} holds no files")
    twice = [path for path, count in collections.Counter(item.path for item in items).items() if count > 1]
    if twice:
        raise DataError(f"--data {data} names {twice[0]!r} twice" + (f" (and {len(twice) - 1} more)" if len(twice) > 1
                        else "") + "; each path is one output line")
    return items


def check_outside(data: Path, output: Path | None, option: str) -> None:
    """DataError when ``output`` (``option``'s) is inside the folder ``data``: a rerun would list it, its parts and
    the files beside it as inputs and write a line of error for each."""
    if output is not None and data.is_dir() and Path(os.path.abspath(output)).is_relative_to(os.path.abspath(data)):
        raise DataError(f"{option} {output} is inside --data {data}: a rerun would score it and the files beside it "
                        f"as inputs; write it outside the folder")


def chunks_for_rank(items: list[Item], chunk: int, rank: int, world_size: int) -> list[list[Item]]:
    """This rank's batches: the items cut into consecutive chunks of ``chunk``, dealt round robin. Each chunk is one
    batch whatever the number of ranks, so an image meets the same neighbours (and the same kernels) on 1 or N."""
    cut = [items[start:start + chunk] for start in range(0, len(items), chunk)]
    return cut[rank::world_size]


class Labels:
    """Each input's true class: from a ``DIR/<class>/...`` folder (the first folder under DIR) or a CSV of
    ``path,label`` rows (paths relative to the CSV's folder; a ``path,label`` header is skipped)."""

    def __init__(self, source: Path) -> None:
        self.source = source
        self.root = os.path.abspath(source) if source.is_dir() else None
        self.table = {} if source.is_dir() else self._read_csv(source)

    @staticmethod
    def _read_csv(source: Path) -> dict[str, str]:
        if not source.is_file():
            raise DataError(f"--labels {source} is neither a DIR/<class>/ folder nor a CSV of path,label")
        table = {}
        with io.StringIO(utf8_text(source, "--labels"), newline="") as handle:
            for row in csv.reader(handle):
                if len(row) < 2 or row[:2] == ["path", "label"]:
                    continue
                name = row[0].strip()
                table[os.path.abspath(name if os.path.isabs(name) else os.path.join(source.parent, name))] = row[1]
        return table

    def split_folder(self) -> Path | None:
        """``DIR/val`` when ``DIR`` is laid out for training (``train/`` and ``val/``, each of ``<class>/``
        folders) rather than as ``DIR/<class>/``: the held-out split an evaluation is meant for."""
        if self.root is None:
            return None
        train, val = self.source / "train", self.source / "val"
        if train.is_dir() and val.is_dir() and any(p.is_dir() for p in val.iterdir()):
            return val
        return None

    def require_some(self, items: Sequence[Item]) -> None:
        """DataError, in one line saying how paths are matched, when not one of ``items`` has a label (a metrics
        file of nothing but unlabelled inputs would say nothing)."""
        if not items or any(self.of(item) is not None for item in items):
            return
        if self.root is not None:
            how = f"each input's label is its first folder under {self.source}, and no input lies under it"
        else:
            first = next(iter(self.table), None)
            how = (f"its paths are read relative to the CSV's own folder {self.source.parent.resolve()} (or as "
                   f"absolute paths): its first row names {first}, the first input is {os.path.abspath(items[0].file)}"
                   if first else "it holds no path,label row")
        raise DataError(f"--labels {self.source}: none of the {len(items)} inputs has a label: {how}")

    def of(self, item: Item) -> str | None:
        """The item's true class, or None when the labels do not name it."""
        file = os.path.abspath(item.file)
        if self.root is None:
            return self.table.get(file)
        inside = os.path.relpath(file, self.root).split(os.sep)
        return inside[0] if len(inside) >= 2 and inside[0] != ".." else None
