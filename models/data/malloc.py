"""glibc malloc tuning for decode buffers: keep freed memory for the next image instead of handing it back.
Applied by every server process that reads or decodes images (app/factory.py's ``create_app``: the HTTP workers of
both engine modes; app/link/server.py: the engine processes; MALLOC_TRIM_THRESHOLD_MB) and by models.predict before
its DataLoader's workers start (they inherit it).

A 12 MP JPEG decoded at half scale needs about 9 MB of pixels. glibc serves blocks that large with mmap (or
trims them off a thread's arena on free), so every request that lands on a request thread pays the page faults
again: measured here, the median decode + preprocess took 15 ms in the server against 9.5 ms in one process, and
models.predict's two decoding workers spent 2.4-2.9 s of system time on 432 photos against 1.0 s tuned.
Serving such blocks from the arenas and trimming only above a threshold brings the server to the in-process time.

Each arena keeps its own freed memory (up to the threshold, and the fragments between live blocks), and glibc makes
up to 8 a core, a new one for each thread that starts allocating until then: an inline worker held up to 1.2-1.4 GB
after 150 s of mixed photos on a 2-core VM (16 arenas), up to 0.93-1.04 GB with 4 (MALLOC_ARENA_MAX, ``arena_max``:
the server's processes run their Python under one lock, so few of their threads allocate at once).
"""
from __future__ import annotations

import ctypes
import logging
import platform

log = logging.getLogger(__name__)

# From glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# glibc's ceiling for M_MMAP_THRESHOLD on 64-bit: blocks up to 32 MiB can come from the arenas.
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024
# What each arena keeps in models.predict; the server's MALLOC_TRIM_THRESHOLD_MB defaults to the same (a test checks).
DEFAULT_TRIM_THRESHOLD_MB = 64


def keep_freed_memory(trim_threshold_mb: int, arena_max: int = 0) -> bool:
    """Let each malloc arena keep up to ``trim_threshold_mb`` of freed memory, and make at most ``arena_max`` arenas
    (threads that start allocating later share them); 0 leaves glibc's default of each. Called before the process's
    threads allocate much: an arena made already stays.

    Returns whether the freed-memory tuning is in effect (False on 0 and where the C library is not glibc, e.g. musl,
    macOS).
    """
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    if arena_max and libc.mallopt(_M_ARENA_MAX, arena_max) != 1:
        log.warning("mallopt refused M_ARENA_MAX=%d; glibc makes up to 8 arenas a core", arena_max)
    if trim_threshold_mb == 0:
        return False
    applied = (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
               and libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold_mb * 1024 * 1024) == 1)
    if not applied:
        log.warning("mallopt refused the decode-buffer tuning; decoding large images stays slower")
    return applied
