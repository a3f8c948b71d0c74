"""CONTROL_DIR: the directory the gunicorn master makes before the fork, shared by the master, the HTTP workers and
the engine processes. Every name in it is made here and nowhere else:

- ``desired.json`` and ``lock``: the desired state and its file lock (app/engine/versions/desired.py);
- ``worker-<pid>.json``: what each process that serves models reports (an inline worker, or an engine), with the
  process's start time (``start_time``): a later process given the same pid is not taken for it;
- ``engine-<slot>.sock``: where engine ``slot`` listens; ``engine-<slot>.failed``: why it cannot serve;
- ``loads-<device>.lock``: held by the process loading a version onto that GPU, from its memory check until the
  version has warmed up (app/engine/versions/memory.py: two engines, or inline workers, of one GPU each saw the
  memory free that the other was about to take);
- ``http-<pid>.ready``: an HTTP worker that serves: it reached a ready engine, or loaded its models inline, and is
  not draining; away while its engine restarts or does not answer (readiness counts the live workers' marks in
  process mode; a worker that has none leaves new connections to those that have one, app/hosting/worker.py, and
  to those of the master beside it: ``masters_beside``);
- ``http-<pid>.leaving``: an HTTP worker that served and drains, answering what comes for the drain's first
  SHUTDOWN_DRAIN_S (a HUP's old worker, or every worker of a server stopping): not ready, but a worker still
  loading leaves new connections to it, as to one that serves, and it takes them while none serves;
- ``http-<pid>.loading``: an HTTP worker from its fork until it serves (or drains): a HUP's new worker, for which
  the old one, draining, answers on past SHUTDOWN_DRAIN_S while none serves (``replacement_loading``);
- ``successor``: the CONTROL_DIR of the master a USR2 of this one started, written by that master at its start (it
  is told this one's by ``PREDECESSOR_VARIABLE``);
- ``batch-cap-*`` and ``monitor-reference-*.json``: a version's measured batch cap and drift reference, kept for
  its later starts (a USR2's new master takes them, and the desired state, into its own new CONTROL_DIR:
  ``carry_over``).

Standard library only: the master imports it, and so does the engine (the desired state's names).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Sequence

DESIRED = "desired.json"
LOCK = "lock"
REPORTS = "worker-*.json"
READY_MARKS = "http-*.ready"
LEAVING_MARKS = "http-*.leaving"
LOADING_MARKS = "http-*.loading"
BOOT_FAILURES = "boot-*.failed"  # why a master's first worker that could not start could not (``boot_failure``)
# What the engines and the HTTP workers leave behind (a master starting on a kept directory clears them).
SUCCESSOR = "successor"  # in a master's CONTROL_DIR: the CONTROL_DIR of the master its USR2 started (which writes it)
BATCH_CAPS = "batch-cap-*"  # a version's batch cap as its first start in this server measured it (``batch_cap``)
MONITOR_REFERENCES = "monitor-reference-*.json"  # a version's drift reference (``monitor_reference``)
# What USR2's new master takes from its predecessor's CONTROL_DIR into a new one of its own (``carry_over``)
CARRIED_OVER = (DESIRED, MONITOR_REFERENCES, BATCH_CAPS)
STALE_AT_START = ("engine-*.failed", "engine-*.sock", READY_MARKS, LEAVING_MARKS, LOADING_MARKS, REPORTS,
                  BOOT_FAILURES, SUCCESSOR, BATCH_CAPS)
_HAS_PROC = Path("/proc/self/status").exists()  # Linux: a pid's process is looked up there (``process_alive``)


def unwritable(control_dir: Path) -> str | None:
    """Why ``control_dir`` cannot be made or written (the OS's error), or None: a file is written there and removed.
    Every process of the server writes there (the desired state, the marks, an engine's failure), so a server that
    cannot is refused at its start rather than restarting its engines, or failing its first load, without end."""
    probe = control_dir / f".writable-{os.getpid()}"
    try:
        control_dir.mkdir(parents=True, exist_ok=True)
        probe.touch()
        probe.unlink()
    except OSError as exc:
        return f"{exc.strerror or exc} ({exc.filename or control_dir})"
    return None


def clear_stale(control_dir: Path) -> None:
    """What an earlier server left in a kept CONTROL_DIR (``STALE_AT_START``): removed before this one starts (a
    killed worker's ready mark or report could otherwise name a live process of this start, pids being reused: its
    report a worker that every load and unload call waits for, in vain)."""
    for pattern in STALE_AT_START:
        for stale in control_dir.glob(pattern):
            stale.unlink(missing_ok=True)


def batch_cap(control_dir: Path, measured: str) -> Path:
    """Where the batch cap of what ``measured`` names (a version on a device, its dtype and batch ceiling) is kept
    once a start in this server measured it: a later start of it (an engine or a worker restarted under load, a
    reload) takes it instead of measuring beside busy work (app/engine/loaded/version.py ``_apply_batch_cap``)."""
    return control_dir / f"batch-cap-{hashlib.sha256(measured.encode()).hexdigest()[:24]}"


def monitor_reference(control_dir: Path, taken: str) -> Path:
    """Where the drift reference a start of what ``taken`` names (a version by its files) took from its first
    predictions is kept: later starts judge by it (app/engine/loaded/version.py ``_keep_reference``)."""
    return control_dir / MONITOR_REFERENCES.replace("*", hashlib.sha256(taken.encode()).hexdigest()[:24])


def carry_over(predecessor: Path, control_dir: Path) -> list[str]:
    """What USR2's new master takes from the CONTROL_DIR of the master that started it into its own new one
    (``CARRIED_OVER``): the models' desired state (what calls and rollouts changed: an unload, a rollback, a held
    default), its versions' drift references and their measured batch caps, each copied whole (``_write_whole``);
    the names copied. Without it the new master served the repository's policies afresh: a
    version rolled back from served again (an upgrade trial)."""
    copied = []
    for pattern in CARRIED_OVER:
        for found in sorted(predecessor.glob(pattern)):
            try:
                data = found.read_bytes()  # (each written whole by its writer: write_json, or the same rename)
            except OSError:  # removed meanwhile (the old master stopping): nothing of it to take
                continue
            _write_whole(control_dir / found.name, data)
            copied.append(found.name)
    return copied


def write_json(path: Path, data: Any) -> None:
    """``data`` as JSON in ``path`` of a CONTROL_DIR, whole or not at all for any reader (``_write_whole``)."""
    _write_whole(path, json.dumps(data, sort_keys=True).encode("utf-8"))


def _write_whole(path: Path, data: bytes) -> None:
    """``data`` in ``path``, written beside it, then put in its place: a process reads the old file or the new one,
    never half of one."""
    written = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    written.write_bytes(data)
    written.replace(path)


def report(control_dir: Path, pid: int) -> Path:
    """What process ``pid`` serves (its versions, device and rollout evidence)."""
    return control_dir / f"worker-{pid}.json"


def socket_path(control_dir: Path, slot: int) -> Path:
    """Where engine ``slot`` listens."""
    return control_dir / f"engine-{slot}.sock"


def _boot_failure_file(control_dir: Path, master_pid: int) -> Path:
    # by master: a USR2 master's failed start is not said by the old master when it stops, nor by a later one
    return control_dir / f"boot-{master_pid}.failed"


def tell_boot_failure(control_dir: Path, master_pid: int, reason: str) -> None:
    """Write why this worker of ``master_pid`` cannot start, unless another of its workers wrote its reason first
    (best effort: a directory that cannot be written leaves it to the worker's own log line)."""
    try:
        with _boot_failure_file(control_dir, master_pid).open("x", encoding="utf-8") as file:
            file.write(reason)
    except OSError:
        pass


def boot_failure(control_dir: Path, master_pid: int) -> str | None:
    """Why the first worker of ``master_pid`` that could not start could not (``tell_boot_failure``), the file then
    removed; None when none said."""
    said = _boot_failure_file(control_dir, master_pid)
    try:
        reason = said.read_text(encoding="utf-8") or None
    except OSError:
        return None
    said.unlink(missing_ok=True)
    return reason


def engine_failure(control_dir: Path, slot: int) -> Path:
    """Where engine ``slot`` writes why it cannot serve (it then exits with status 3)."""
    return control_dir / f"engine-{slot}.failed"


def device_loads_lock(control_dir: Path, device: str) -> Path:
    """The file lock the processes loading onto ``device`` ("cuda:0") take in turn."""
    return control_dir / f"loads-{device.replace(':', '-')}.lock"


def ready_mark(control_dir: Path, pid: int) -> Path:
    """The file an HTTP worker writes once it reaches a ready engine (again, after its engine's restart)."""
    return control_dir / f"http-{pid}.ready"


def leaving_mark(control_dir: Path, pid: int) -> Path:
    """The file an HTTP worker that served writes as its drain begins, away once the drain stops answering."""
    return control_dir / f"http-{pid}.leaving"


def loading_mark(control_dir: Path, pid: int) -> Path:
    """The file an HTTP worker writes as it starts, away once it serves or drains (or ends)."""
    return control_dir / f"http-{pid}.loading"


def replacement_loading(control_dir: Path, pid: int) -> bool:
    """Whether another live HTTP worker is still loading while none other serves: for a draining worker ``pid``
    (a HUP's old one), a new worker on its way that would otherwise leave new connections unanswered. A directory
    that cannot be looked into: False (the drain ends as it would)."""
    try:
        return (any(other != pid for other in _marked(control_dir, LOADING_MARKS))
                and not any(other != pid for other in ready_workers(control_dir)))
    except OSError:
        return False


PREDECESSOR_VARIABLE = "_VISIONSERVE_PREDECESSOR_CONTROL_DIR"  # the CONTROL_DIR of the master that started this one
# (gunicorn's USR2: the old master serves on beside it until it is stopped), set by gunicorn.conf.py's pre_exec


def masters_beside(control_dir: Path) -> list[Path]:
    """The CONTROL_DIRs of the masters that serve beside this one behind the same listener (USR2's old master, told
    by ``PREDECESSOR_VARIABLE``, and its new one, by ``SUCCESSOR``), those still there."""
    named = [os.environ.get(PREDECESSOR_VARIABLE)]
    try:
        named.append((control_dir / SUCCESSOR).read_text(encoding="utf-8").strip())
    except OSError:
        pass
    return [Path(path) for path in named if path and Path(path).is_dir() and Path(path) != control_dir]


def serving_beside(control_dir: Path, beside: Sequence[Path] | None = None) -> bool:
    """A live worker of a master beside this one (``masters_beside``, unless given) serves (its ready mark) or still
    answers in its drain (its leaving mark)."""
    try:
        return any(ready_workers(other) or _marked(other, LEAVING_MARKS)
                   for other in (masters_beside(control_dir) if beside is None else beside))
    except OSError:
        return False


def takes_connections(control_dir: Path, pid: int, beside: Sequence[Path] | None = None) -> bool:
    """Whether HTTP worker ``pid`` should take new connections now: it serves (its ready mark is there); or no
    other live worker serves, of this master or of one beside it (USR2's old or new one: ``serving_beside``), and
    it is leaving (its drain still answers), or none other is (a server starting, or its one engine restarting: each
    answers 503 meanwhile, rather than none answering). A directory that cannot be looked into leaves every worker
    taking them."""
    try:
        if ready_mark(control_dir, pid).exists():
            return True
        if any(other != pid for other in ready_workers(control_dir)):
            return False
        if serving_beside(control_dir, beside):
            return False
        return leaving_mark(control_dir, pid).exists() or all(other == pid for other in _marked(control_dir,
                                                                                                 LEAVING_MARKS))
    except OSError:
        return True


def _pid_of(path: Path, prefix: str, suffix: str) -> int | None:
    middle = path.name[len(prefix):-len(suffix)]
    return int(middle) if path.name.startswith(prefix) and path.name.endswith(suffix) and middle.isdigit() else None


def report_pid(path: Path) -> int | None:
    """The pid a report file (``report``) belongs to; None for any other name."""
    return _pid_of(path, "worker-", ".json")


def ready_workers(control_dir: Path) -> list[int]:
    """The HTTP workers whose ready mark is there and that still live (a killed worker's mark does not count)."""
    return _marked(control_dir, READY_MARKS)


def _marked(control_dir: Path, pattern: str) -> list[int]:
    """The live processes whose mark of ``pattern`` (``http-*.<kind>``) is there."""
    suffix = pattern[len("http-*"):]
    pids = (_pid_of(path, "http-", suffix) for path in control_dir.glob(pattern))
    return sorted(pid for pid in pids if pid is not None and process_alive(pid))


def process_alive(pid: int, started: int | None = None) -> bool:
    """Whether process ``pid`` exists (a zombie counts until its parent reaps it): a process, not a thread of one
    (a thread's id answers a signal too), and, given ``started`` (``start_time``), the one that started then, not a
    later process given the same pid. Without /proc (not Linux): whether anything answers to the pid."""
    if pid <= 0:  # 0 and -1 would signal a process group, or every process
        return False
    try:
        status = Path(f"/proc/{pid}/status").read_text(encoding="utf-8")
    except FileNotFoundError:
        return not _HAS_PROC and _answers_signal(pid)
    except OSError:
        return _answers_signal(pid)
    group = next((line.split()[1] for line in status.splitlines() if line.startswith("Tgid:")), None)
    return group == str(pid) and (started is None or start_time(pid) == started)


def start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot (/proc/<pid>/stat's field 22); None when /proc does
    not say."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()
        return int(fields[19])  # after the command name: state is field 3, so field 22 is index 19
    except (OSError, IndexError, ValueError):
        return None


def _answers_signal(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True
