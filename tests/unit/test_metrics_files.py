"""app/hosting/metrics_files.py: an ended process's counts folded into one file of each kind, the totals a scrape
reads unchanged, and no fold while a scrape reads."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector

from app.hosting import metrics_files


def _counts(folder: Path, pid: int, requests: float, seconds: list[float]) -> None:
    """What process ``pid`` would have written: a counter of ``requests`` and a histogram of ``seconds``."""
    counter = MmapedDict(str(folder / f"counter_{pid}.db"))
    counter.write_value(mmap_key("served", "served_total", ["route"], ["/predict"], "served"), requests, 0.0)
    counter.close()
    histogram = MmapedDict(str(folder / f"histogram_{pid}.db"))
    for bound in ("0.1", "1.0", "+Inf"):
        within = float(sum(1 for value in seconds if value <= float(bound)))
        below = float(sum(1 for value in seconds if value <= {"0.1": 0.0, "1.0": 0.1, "+Inf": 1.0}[bound]))
        key = mmap_key("took", "took_bucket", ["route", "le"], ["/predict", bound], "took")
        histogram.write_value(key, within - below, 0.0)  # (each bucket's own count: a scrape adds them up)
    histogram.write_value(mmap_key("took", "took_sum", ["route"], ["/predict"], "took"), sum(seconds), 0.0)
    histogram.close()
    gauge = MmapedDict(str(folder / f"gauge_livesum_{pid}.db"))  # its live gauges: not the fold's
    gauge.write_value(mmap_key("queued", "queued", [], [], "queued"), 3.0, 0.0)
    gauge.close()


def _scraped(folder: Path) -> str:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(folder))
    with metrics_files.reading(folder):
        return generate_latest(registry).decode()


def test_an_ended_process_s_counts_fold_into_one_file_of_each_kind_and_the_totals_stay(tmp_path: Path) -> None:
    # Before: every HTTP worker a HUP replaced and every engine restart left its counter and histogram files, and
    # every scrape read them all (a soak: 4 files of 64 KiB each HUP of two workers, for the server's whole life).
    _counts(tmp_path, 101, 5, [0.05, 0.5])
    _counts(tmp_path, 102, 7, [2.0])
    _counts(tmp_path, 103, 11, [0.05])  # a live one
    before = _scraped(tmp_path)
    assert 'served_total{route="/predict"} 23.0' in before and 'took_count{route="/predict"} 4.0' in before

    assert metrics_files.fold_ended(tmp_path, 101) == 2
    assert metrics_files.fold_ended(tmp_path, 102) == 2
    assert metrics_files.fold_ended(tmp_path, 102) == 0  # (told twice: nothing left of it)
    after = _scraped(tmp_path)
    counts = sorted(path.name for path in tmp_path.glob("*.db"))
    assert counts == ["counter_103.db", "counter_ended.db", "gauge_livesum_101.db", "gauge_livesum_102.db",
                      "gauge_livesum_103.db", "histogram_103.db", "histogram_ended.db"]
    wanted = {line for line in before.splitlines() if not line.startswith("queued")}
    assert wanted == {line for line in after.splitlines() if not line.startswith("queued")}
    assert 'took_bucket{le="1.0",route="/predict"} 3.0' in after and 'took_count{route="/predict"} 4.0' in after

    _counts(tmp_path, 104, 2, [0.5])  # a later one ended: added to what was folded
    metrics_files.fold_ended(tmp_path, 104)
    assert 'served_total{route="/predict"} 25.0' in _scraped(tmp_path)


def test_no_fold_while_a_scrape_reads(tmp_path: Path) -> None:
    _counts(tmp_path, 101, 5, [0.05])
    folded = threading.Event()
    with metrics_files.reading(tmp_path):
        folding = threading.Thread(target=lambda: (metrics_files.fold_ended(tmp_path, 101), folded.set()))
        folding.start()
        assert not folded.wait(0.3)  # the fold waits for the scrape
        assert (tmp_path / "counter_101.db").exists() and not (tmp_path / "counter_ended.db").exists()
    folding.join(10)
    assert folded.is_set() and not (tmp_path / "counter_101.db").exists()


def test_a_scrape_waits_for_a_fold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # /metrics (app/metrics.py's render) reads the folder under the lock a fold takes: the counts of an ended process
    # once, folded or not yet (before or after the fold, never between its write and its removal)
    import fcntl

    from app.metrics import render

    _counts(tmp_path, 101, 5, [0.05])
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    scraped: list[bytes] = []
    with metrics_files._locked(tmp_path, fcntl.LOCK_EX):  # a fold under way
        scraping = threading.Thread(target=lambda: scraped.append(render()[0]))
        scraping.start()
        scraping.join(0.3)
        assert scraping.is_alive() and not scraped  # the scrape waits for it
    scraping.join(30)
    assert scraped and b'served_total{route="/predict"} 5.0' in scraped[0]


def test_the_master_folds_an_ended_worker_s_counts(tmp_path: Path) -> None:
    # gunicorn.conf.py's _forget (child_exit, and the engine supervisor's for an ended engine)
    import os
    import subprocess
    import sys

    _counts(tmp_path, 4242, 5, [0.05])
    (tmp_path / "counter_4343.db").write_bytes(b"\xff\x00\x00\x00" + b"\x01" * 60)  # one that does not read
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "VISIONSERVE_CONTROL_DIR": str(tmp_path),
           "VISIONSERVE_ENGINE": "inline", "VISIONSERVE_DEVICE": "cpu"}
    forget = ("import logging, runpy; from types import SimpleNamespace; c = runpy.run_path('gunicorn.conf.py'); "
              "server = SimpleNamespace(log=logging.getLogger('master')); c['_forget'](server, 4242); "
              "c['_forget'](server, 4343)")  # the second said in the log, never raised into the master's loop
    done = subprocess.run([sys.executable, "-c", forget], cwd=Path(__file__).resolve().parents[2], check=True,
                          capture_output=True, text=True, timeout=60, env=env)
    assert "the metrics files of process 4343 could not be folded" in done.stderr
    assert sorted(path.name for path in tmp_path.glob("*.db")) == ["counter_4343.db", "counter_ended.db",
                                                                   "histogram_ended.db"]
    (tmp_path / "counter_4343.db").unlink()
    assert 'served_total{route="/predict"} 5.0' in _scraped(tmp_path)
