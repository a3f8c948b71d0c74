"""Instruction counts under valgrind's callgrind: a process started with counting off, turned on, zeroed and dumped
around the requests counted, and the count of the last dump (``http_side --instructions``, ``engine_only
--instructions``)."""
from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path


def callgrind_command(out: Path) -> list[str]:
    """What runs a command under callgrind with counting off until ``callgrind_control --instr=on``, its dumps written
    to ``out``.1, .2, ..."""
    return ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]


def callgrind_control(pid: int, option: str) -> None:
    """``callgrind_control option`` for the process ``pid`` runs under callgrind (``callgrind_command``)."""
    subprocess.run(["callgrind_control", option, str(pid)], check=True, capture_output=True)


def callgrind_total(out: Path) -> int:
    """The instruction count of the last dump callgrind wrote to ``out`` (``--callgrind-out-file``; its dumps are
    ``out``.1, .2, ...)."""
    dumps = sorted(out.parent.glob(f"{out.name}.*"), key=lambda path: int(path.suffix[1:]))
    totals = next(line for line in dumps[-1].read_text().splitlines() if line.startswith(("summary:", "totals:")))
    return int(totals.split()[1])


def remove_vgdb_pipes(pid: int) -> None:
    """The FIFOs and the shared-memory file valgrind's gdbserver made for process ``pid`` (callgrind_control talks to
    it through them), which a process killed under valgrind leaves in the temporary folder (three a run)."""
    for pipe in Path(tempfile.gettempdir()).glob(f"vgdb-pipe-*[-]{pid}-by-*"):
        pipe.unlink(missing_ok=True)
