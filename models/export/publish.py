"""An export's folder made whole or not at all: written beside its place under a hidden name no server lists and
no other export takes (``hidden_beside``), then published (``publish``): a new folder claimed by one rename (two
exports never share one; a numbered one that finds its number taken takes the next), a folder holding an export
swapped whole (one atomic exchange where Linux has it), a folder of other files given the export's files, its
manifest last. What another export's folder holds (``held_by``) is never replaced unasked (``check_replace``). An
export's hidden folder is held (a lock on it) while the export runs: one an export killed left behind (SIGKILL, a
power cut: nothing ran its clean-up), no longer held, is removed by the next export beside it (``staging_beside``)."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import secrets
import shutil
import sys
import time
from pathlib import Path
from typing import Iterator

from models.export.manifest import MANIFEST_NAME, Manifest, read_manifest, write_manifest
from models.export.repository import is_export, next_version

log = logging.getLogger("models.export")

STAGING_KIND = "partial"
ABANDONED_AFTER_S = 60.0  # an unheld staging folder untouched this long is an abandoned one (not one just made)


def held_by(out_dir: Path) -> str | None:
    """What ``out_dir`` holds, as "name version", or None when it holds no export."""
    if not (out_dir / MANIFEST_NAME).exists():
        return None
    try:
        held = read_manifest(out_dir)
        return f"{held.name} {held.version}"
    except Exception:  # noqa: BLE001 - an unreadable manifest is still something not to destroy silently
        return "an unreadable model"


def check_replace(out_dir: Path, name: str, version: str) -> None:
    """Refuse to overwrite a different model (another name or version) in ``out_dir``: FileExistsError."""
    found = held_by(out_dir)
    if found is not None and found != f"{name} {version}":
        raise FileExistsError(f"{out_dir} already holds {found}: export {name} {version} into a new directory "
                              f"(e.g. --out runs/<run>/export) and serve it with VISIONSERVE_WEIGHTS_DIR, or "
                              f"pass --force to replace it")


def hidden_beside(folder: Path, kind: str) -> Path:
    """A name beside ``folder`` no other process takes and the server never lists (hidden: outside NAME_PATTERN)."""
    return folder.parent / f".{folder.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


@contextlib.contextmanager
def staging_beside(out_dir: Path) -> Iterator[Path]:
    """A new hidden folder beside ``out_dir`` to write an export into (``.<its name>.partial-<pid>-<random>``), held
    by this process (an exclusive lock on the folder) until the export ends, then removed with what is left in it (a
    failed export's files, or the old export a swap put there; a published folder has gone from that name). First
    the staging folders beside it that no export holds any longer are removed (``remove_abandoned``)."""
    remove_abandoned(out_dir.parent)
    staging = hidden_beside(out_dir, STAGING_KIND)
    staging.mkdir()
    held = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with contextlib.suppress(OSError):  # a file system without locks: the folder is removed as before
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        os.close(held)


def remove_abandoned(parent: Path) -> None:
    """Remove the export staging folders in ``parent`` that their export left when it was killed: none holds its
    lock, and none was touched in ``ABANDONED_AFTER_S`` (so not one an export has just made and not yet locked).
    A folder a running export holds, or one on a file system without locks, is left."""
    for folder in parent.glob(f".*.{STAGING_KIND}-*"):
        try:
            if folder.is_symlink() or not folder.is_dir() or time.time() - folder.stat().st_mtime < ABANDONED_AFTER_S:
                continue
            held = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a running export's (or no locks here: nothing can tell)
        else:
            shutil.rmtree(folder, ignore_errors=True)
            log.warning("removed %s: an export killed before it ended left it", folder)
        finally:
            os.close(held)


def publish(staging: Path, out_dir: Path, manifest: Manifest, *, force: bool,
             numbered: bool) -> tuple[Path, Manifest]:
    """Move the complete export in ``staging`` to ``out_dir``, its manifest written there last; returns where it
    went and its manifest. A new folder is one rename, which fails when the folder exists: two exports never
    share one, and with ``numbered`` the one that finds its number taken takes the next. Over a folder holding an
    export the whole folder is swapped (swap); into one holding no export (other files) each file is moved in,
    the manifest last."""
    while True:
        write_manifest(staging, manifest)
        if claim(staging, out_dir):
            return out_dir, manifest
        if not numbered:
            break
        version = str(max(int(manifest.version) + 1, int(next_version(out_dir.parent.parent, manifest.name))))
        out_dir, manifest = out_dir.parent / version, manifest.model_copy(update={"version": version})
    if not is_export(out_dir):
        for entry in sorted(staging.iterdir(), key=lambda entry: entry.name == MANIFEST_NAME):  # the manifest last
            entry.replace(out_dir / entry.name)
        return out_dir, manifest
    if not force:  # another export may have written it since the first check
        check_replace(out_dir, manifest.name, manifest.version)
    swap(staging, out_dir)
    return out_dir, manifest


def claim(staging: Path, out_dir: Path) -> bool:
    """``staging`` renamed to ``out_dir`` (True), or False when ``out_dir`` exists and is not empty: one rename,
    so of two exports claiming one folder, one gets it whole and the other is told."""
    try:
        staging.rename(out_dir)  # onto an existing folder only when it is empty (POSIX rename)
    except OSError as exc:
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
        return False
    return True


def is_export_file(name: str) -> bool:
    """A file name an export writes (manifest.json and its .tmp, model.*); anything else in its folder is not
    its own (weights/README.md)."""
    return name.startswith((MANIFEST_NAME, "model."))


def swap(new: Path, old: Path) -> None:
    """The export in ``new`` put in place of the one in ``old``, keeping what else ``old`` holds (a README), and the
    old export removed (left in ``new``). One atomic exchange where the system has it (Linux renameat2), so a
    server polling ``old`` finds the one export or the other, never none; elsewhere the old folder is renamed aside,
    then the new one in."""
    carried = [entry.name for entry in old.iterdir()
               if not is_export_file(entry.name) and not (new / entry.name).exists()]
    for entry in carried:
        (old / entry).rename(new / entry)
    shutil.copymode(old, new)
    try:
        if not exchange(new, old):
            aside = hidden_beside(old, "old")
            old.rename(aside)
            try:
                new.rename(old)
            except OSError:
                aside.rename(old)
                raise
            aside.rename(new)  # removed with ``new`` by export_model
    except OSError:
        for entry in carried:  # back where they were: ``new`` is removed
            (new / entry).rename(old / entry)
        raise


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # linux/fcntl.h, linux/fs.h


def exchange(first: Path, second: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where the system or its file system
    has no such call."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if sys.platform == "linux" else None
    if renameat2 is None:
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # an older kernel or a file system without it
        return False
    raise OSError(code, os.strerror(code), str(second))
