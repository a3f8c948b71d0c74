"""Decode buffers come from malloc's arenas (reused) rather than fresh mmaps, where the C library is glibc."""
from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from app.config import Settings
from models.data.malloc import DEFAULT_TRIM_THRESHOLD_MB, keep_freed_memory
from harness.servers import ROOT

# Allocates a block the size of a half-scale 12 MP image, then prints the bytes glibc holds in mmapped blocks.
_PROBE = """
import ctypes, sys
from models.data.malloc import keep_freed_memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
print(keep_freed_memory(int(sys.argv[1])))
before = libc.mallinfo2().hblkhd
block = libc.malloc(9 * 1024 * 1024)
print(libc.mallinfo2().hblkhd - before)
"""

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")


def _mmapped_bytes_for_a_9mb_block(trim_threshold_mb: int) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, str(trim_threshold_mb)], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    return out[0], int(out[1])


@glibc_only
def test_large_blocks_come_from_the_arena_when_tuned() -> None:
    assert _mmapped_bytes_for_a_9mb_block(64) == ("True", 0)
    applied, mmapped = _mmapped_bytes_for_a_9mb_block(0)  # glibc's defaults: a fresh mmap per large block
    assert applied == "False" and mmapped >= 9 * 1024 * 1024


_ARENAS = """
import ctypes, os, sys, tempfile, threading
from models.data.malloc import keep_freed_memory
keep_freed_memory(0, int(sys.argv[1]))
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.fopen.restype = ctypes.c_void_p
started, go = threading.Barrier(9), threading.Event()
def allocate():  # 8 threads allocating at once, each holding its block: glibc gives each an arena it can
    block = libc.malloc(1 << 20)
    started.wait()
    go.wait()
threads = [threading.Thread(target=allocate) for _ in range(8)]
for thread in threads:
    thread.start()
started.wait()
path = tempfile.mktemp()
stream = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, ctypes.c_void_p(stream))
libc.fclose(ctypes.c_void_p(stream))
go.set()
print(open(path).read().count("<heap nr="))
os.unlink(path)
"""


@glibc_only
def test_the_arenas_are_at_most_malloc_arena_max() -> None:
    # Before: glibc's 8 a core, each keeping its own freed memory (an inline worker: up to 1.2-1.4 GB after 150 s of
    # mixed photos on 2 cores, against 0.93-1.04 GB with 4 arenas: bench.serving.worker_memory)
    def arenas(arena_max: int) -> int:
        return int(subprocess.run([sys.executable, "-c", _ARENAS, str(arena_max)], cwd=ROOT, capture_output=True,
                                  text=True, check=True, timeout=60).stdout)

    assert arenas(2) <= 2 < arenas(0)
    assert Settings().malloc_arena_max > 0


def test_zero_turns_it_off_and_the_default_is_on() -> None:
    assert keep_freed_memory(0) is False
    # models.predict applies the module's default (it reads no server settings): the two stay one value
    assert Settings().malloc_trim_threshold_mb == DEFAULT_TRIM_THRESHOLD_MB > 0


@pytest.mark.parametrize("engine", ["process", "inline"])
def test_every_worker_keeps_freed_memory_the_http_side_of_process_mode_too(
        engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: only the processes that decode applied it: an HTTP worker of ENGINE=process read each ~100 KB photo
    # body into memory glibc had trimmed off its heap after the last one (24 page faults a request, measured)
    import app.factory as factory

    applied: list[tuple[int, int]] = []
    monkeypatch.setattr("models.data.malloc.keep_freed_memory", lambda *args: applied.append(args))
    monkeypatch.setattr("app.web.init_app", lambda app, settings, service, protocols: None)
    monkeypatch.setattr(factory, "_remote_service", lambda settings, on_error: object())
    monkeypatch.setattr(factory, "_inline_service", lambda settings, predictor, on_load_error, source: object())
    factory.create_app(Settings(malloc_trim_threshold_mb=48, malloc_arena_max=3, log_level="warning"), engine=engine)
    assert applied == [(48, 3)]
