"""The kernel-count benchmark (bench/serving/kernel_counts.py) reads perf's counts right and, where perf may count,
counts a served request's system calls and page faults in the HTTP workers and the engine apart."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.serving import kernel_counts

ROOT = Path(__file__).resolve().parents[2]


def test_perfs_csv_counts_are_read_by_event_and_shown_per_request_largest_first(tmp_path: Path) -> None:
    out = tmp_path / "http.txt"
    out.write_text("# started on Tue Dec  1 08:39:00 2026\n\n"
                   "1200,,page-faults,5000,100.00,,\n"
                   "<not counted>,,syscalls:sys_enter_mremap,0,0.00,,\n"
                   "300,,syscalls:sys_enter_ioctl,5000,100.00,,\n")
    assert kernel_counts.counted(out) == {"page-faults": 1200, "ioctl": 300}
    rows = kernel_counts.table([{"server": "process", "form": "jpeg", "http": {"page-faults": 12.0, "ioctl": 3.0,
                                                                              "brk": 0.001}}])
    assert rows.splitlines()[-1] == "| process | jpeg | http | page-faults 12.00, ioctl 3.00 |"


@pytest.mark.slow
def test_the_smoke_run_counts_a_served_requests_calls_in_its_workers_and_its_engine() -> None:
    why_not = kernel_counts.usable()
    if why_not is not None:
        pytest.skip(why_not)
    run = subprocess.run([sys.executable, "-m", "bench.serving.kernel_counts", "--smoke", "--servers", "process",
                          "--forms", "v2 x1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    (point,) = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert point["answered"] > 0 and point["errors"] == 0
    # every request is read from its client and answered to it; the engine hears of it in a message of the loop's
    assert point["http"]["recvfrom"] >= 1 and point["http"]["sendto"] >= 1
    assert 0 < point["engine"]["recvfrom"] + point["engine"].get("recvmsg", 0) <= 1.5
