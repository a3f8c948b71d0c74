"""The gunicorn master's engine processes (``ENGINE=process``): ENGINES_PER_DEVICE per GPU (that many on a CPU
host), each started as ``python -m app.link.server SLOT`` (a fresh interpreter: the master never imports torch or
touches CUDA, and no process that used CUDA is ever forked), watched by a thread, restarted when it dies, stopped
after the HTTP workers at shutdown. Standard library only at import: it runs in the master (which loads the wire,
numpy and no torch, once it starts engines whose state it asks).

- The engines live in this module, not in gunicorn.conf.py: a ``kill -HUP`` executes the config file again, and
  its new globals would forget the engines (and never stop them). A HUP restarts the HTTP workers only; the
  engines keep their models (a new model version arrives through the repository, docs/models.md).
- Each engine runs in a session of its own (a Ctrl-C or a signal to the master's process group reaches the master,
  which stops the engines after the workers) and holds a pipe from the master: if the master dies without
  stopping it, the pipe closes and the engine exits instead of holding the GPU.
- An engine that cannot serve (its model, its settings, its socket) writes why to ``engine-<slot>.failed`` and
  exits; at the first start the HTTP workers read it and stop the server with that message, as a worker that cannot
  load its model does with ``ENGINE=inline``. At a later start (a restart after a crash) the master stops itself
  with the same message (``failure``: gunicorn.conf.py then ends it with status 3, as that boot error does, not
  the 0 of a stop asked for). An engine that dies three times in a row before it listens is taken as failing too.
- An engine that stops answering without dying (SIGSTOP, its loop deadlocked) is killed and restarted as one that
  died: once it listens, the master asks its state every STATE_EVERY_S (a connection of its own, as an HTTP
  worker's, closed after the answer), and an engine whose every state query has gone unanswered for STALL_S is
  killed (SIGKILL), the log saying why. A long batch does not make it silent: the engine's loop answers while its
  batcher's thread runs the batch; a batch that hangs on the loop itself (``ENGINE_LOOP_BATCH_MS``) does. An
  engine whose batch hangs on the batcher's thread answers, and says so: once that batch has run past STALL_S its
  state answer names it (``stalled``: ``Service.stalled``, which fails ``/healthz`` too; warm-up is no batch), and
  the master kills it alike (SIGKILL, the log saying why) to restart it; a batch that ends within STALL_S is never
  taken for stuck.
- An engine's exit status is its watcher's to read, never gunicorn's: the master's reaping takes every child it
  finds ended (``waitpid(-1)``) and keeps no status of one it does not know, so an engine it reaped first was
  logged as exited 0 whatever ended it. The watcher sees the end without reaping (``WNOWAIT``), and the master's
  reaping collects the engines' ends first (``reap_engines_first``); both keep the status on the process.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable

from app.hosting.control import engine_failure, socket_path  # standard library only

if TYPE_CHECKING:
    from app.link.wire import EngineState

log = logging.getLogger("gunicorn.error")
RESTART_DELAY_S = 1.0  # after a crash, before starting it again (a crash loop costs one start a second)
EARLY_CRASHES = 3  # deaths in a row before the engine ever listened that count as a failure to start
STATE_EVERY_S = 5.0  # how often the master asks a listening engine its state
STATE_ANSWER_S = 5.0  # how long it waits for each answer (an engine's loop answers within milliseconds)
ROOT = Path(__file__).resolve().parents[2]  # the checkout: where `python -m app.link.server` finds app
ENGINE_MODULE = "app.link.server"  # what an engine process runs: its command line names it
_ENGINES: list["Engine"] = []  # this master's engines (survives gunicorn.conf.py being executed again)
_FAILURES: list[str] = []  # why the engines that stopped this master cannot serve (``failure``)
_QUERYING: set[int] = set()  # the master's state-query connections open now, by file descriptor


def _close_inherited_queries() -> None:
    """In a process the master forks (a worker) while a state query is open: its copy of that connection closed,
    else the engine would keep the connection, idle, for the worker's whole life."""
    for fd in list(_QUERYING):
        with contextlib.suppress(OSError):
            os.close(fd)
    _QUERYING.clear()


os.register_at_fork(after_in_child=_close_inherited_queries)


class Engine:
    """One engine process and the thread that restarts it."""

    def __init__(self, slot: int, control_dir: Path, on_death: Callable[[int], None], stall_s: float = 0.0) -> None:
        self.slot, self.control_dir, self._on_death = slot, control_dir, on_death
        self.stall_s = stall_s  # killed once silent this long, or stuck (``_watch_answers``); 0: never
        self.process: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.answered_at: float | None = None  # when its process answered the master's state query last
        self._lock = threading.Lock()  # a spawn and a stop never overlap
        self._reaping = threading.Lock()  # the watcher and the master's reaping: one reaps, both read its status
        self._stopping = False

    @property
    def failure(self) -> Path:
        """Where it says why it cannot serve."""
        return engine_failure(self.control_dir, self.slot)

    @property
    def socket(self) -> Path:
        """Where it listens once its models are loaded."""
        return socket_path(self.control_dir, self.slot)

    def start(self) -> "Engine":
        """Start the process and its watcher, and with ``stall_s`` the watch of its answers."""
        with self._lock:
            self._spawn()
        threading.Thread(target=self._watch, name=f"engine-{self.slot}-watch", daemon=True).start()
        if self.stall_s:
            from app.link import wire  # here, before gunicorn forks: never mid-import in a thread at a fork

            threading.Thread(target=self._watch_answers, args=(wire,), name=f"engine-{self.slot}-answers",
                             daemon=True).start()
        return self

    def _spawn(self) -> None:
        self.socket.unlink(missing_ok=True)  # it appears again when this engine listens
        self.process = subprocess.Popen([sys.executable, "-m", ENGINE_MODULE, str(self.slot)], cwd=ROOT,
                                        stdin=subprocess.PIPE, start_new_session=True)
        log.info("engine %d started (pid %d)", self.slot, self.process.pid)

    def _watch(self) -> None:
        early = 0
        while True:
            process = self.process
            assert process is not None
            status = self._ended(process)
            self._on_death(process.pid)
            with self._lock:
                if self._stopping:
                    return
            early = 0 if self.socket.exists() else early + 1
            if early >= EARLY_CRASHES and not self.failure.exists():
                with contextlib.suppress(OSError):  # unwritten (a full disk): it is restarted on, as before
                    self.failure.write_text(f"engine {self.slot} exited {early} times before it could serve "
                                            f"(status {_said(status)}; the log above says why)", encoding="utf-8")
            if self.failure.exists():
                self._failed()
                return
            log.warning("engine %d (pid %d) died with status %s; restarting it", self.slot, process.pid,
                        _said(status))
            if not self._restart():
                return

    def _restart(self) -> bool:
        """Start the process again after RESTART_DELAY_S, and again each RESTART_DELAY_S while the system refuses
        it (a fork or exec that fails for now: EAGAIN, ENOMEM, EMFILE): a watcher that ended there would leave the
        engine dead and every worker answering 503 for good. False once it is stopping."""
        while True:
            time.sleep(RESTART_DELAY_S)
            with self._lock:
                if self._stopping:
                    return False
                try:
                    self._spawn()
                except (OSError, subprocess.SubprocessError) as exc:
                    log.error("engine %d could not be started again (%s); trying again in %.0f s", self.slot, exc,
                              RESTART_DELAY_S)
                    continue
                self.restarts += 1
                return True

    def _watch_answers(self, wire: ModuleType) -> None:
        """Until it is stopping: the engine's state asked every STATE_EVERY_S once its process listens (not while it
        loads its models); one whose every query has gone unanswered for ``stall_s``, or whose answer says a batch of
        it has run past STALL_S, is killed, and ``_watch`` restarts it. One that refuses the master's hello has
        answered (it runs other code than the master: started again after the code changed) and is not asked again
        (it would log each refusal)."""
        process, other_code, silent_since = None, False, None
        while True:
            time.sleep(STATE_EVERY_S)
            with self._lock:
                if self._stopping:
                    return
                current = self.process
            if current is not process:  # started again: its own silence, from its own first query
                process, other_code, silent_since = current, False, None
            if other_code or process is None or not self.socket.exists():
                continue
            asked = time.monotonic()
            answered = self._answers(wire)
            if answered is not False:
                other_code, silent_since, self.answered_at = answered is None, None, time.monotonic()
                # Its loop answers while a batch hangs on its batcher's thread: the answer says so once the batch
                # has run past STALL_S (``Service.stalled``)
                stalled = getattr(answered, "stalled", None)
                if stalled:
                    self._kill(process, f"is stuck, its state answer says: {stalled}")
                continue
            silent_since = asked if silent_since is None else silent_since
            if time.monotonic() - silent_since >= self.stall_s:
                self._kill(process, f"has answered none of the master's state queries for "
                                    f"{time.monotonic() - silent_since:.0f} s (STALL_S={self.stall_s:g}): it is "
                                    "stopped or stuck")

    def _answers(self, wire: ModuleType) -> EngineState | bool | None:
        """Whether the engine answers a state query within STATE_ANSWER_S, on a connection of the master's own (as an
        HTTP worker's): its state when it does (True for an answer without one), else False; None when it refuses
        the master's hello (other code: an answer all the same)."""
        try:
            conn = wire.connect(self.socket, STATE_ANSWER_S)
        except wire.EngineGone:
            return False
        _QUERYING.add(conn.fileno())
        with conn:
            conn.setblocking(False)  # every wait is the wire's
            try:
                wire.say_hello(conn, STATE_ANSWER_S)
                wire.send(conn, wire.StateQuery())
                if not wire.readable(conn, STATE_ANSWER_S):
                    return False
                state = wire.receive_answer(conn, STATE_ANSWER_S).value
                return state if isinstance(state, wire.EngineState) else True
            except wire.WireMismatch:
                return None
            except (wire.EngineGone, OSError):
                return False
            finally:
                _QUERYING.discard(conn.fileno())

    def _kill(self, process: subprocess.Popen[bytes], why: str) -> None:
        """SIGKILL ``process``, the log saying ``why``, unless it ended or is being stopped or replaced meanwhile."""
        with self._lock:
            if self._stopping or process is not self.process:
                return
            self.collect(process)
            if process.returncode is not None:  # it ended: its watcher restarts it
                return
            log.error("engine %d (pid %d) %s; killing it to start it again", self.slot, process.pid, why)
            process.kill()

    def _ended(self, process: subprocess.Popen[bytes]) -> int | None:
        """Wait for ``process`` to end, reap it; its status as Popen says it (-9: killed by SIGKILL), None when
        something else reaped it unseen."""
        try:
            os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)  # its end, seen without reaping it
        except ChildProcessError:  # reaped already, by the master's reaping (collect) or a stop's wait
            pass
        self.collect(process)
        return process.returncode

    def collect(self, process: subprocess.Popen[bytes] | None = None) -> None:
        """Reap the engine's process if it ended, keeping its status on it (``returncode``); never waits."""
        process = process or self.process
        with self._reaping:
            if process is None or process.returncode is not None:
                return
            try:
                pid, status = os.waitpid(process.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: the status is lost, and not taken for a clean exit
                return
            if pid:
                process.returncode = os.waitstatus_to_exitcode(status)

    def _failed(self) -> None:
        reason = self.failure.read_text(encoding="utf-8")
        log.error("engine %d cannot serve: %s", self.slot, reason)
        if self.restarts:  # the workers read it at the first start only: here the master stops itself
            _FAILURES.append(f"engine {self.slot} cannot serve: {reason}")
            os.kill(os.getpid(), signal.SIGTERM)

    def signal_stop(self) -> None:
        """SIGTERM (it finishes what is queued); no restart after it."""
        with self._lock:
            self._stopping = True
            if self.process is not None and self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)

    def wait_stopped(self, timeout_s: float) -> None:
        """Wait for it to exit, SIGKILL after ``timeout_s``."""
        process = self.process
        if process is None:
            return
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("engine %d did not stop within %gs; killing it", self.slot, timeout_s)
            process.kill()
            process.wait()


def _said(status: int | None) -> str:
    """A status for the log: Popen's (-9: killed by SIGKILL), or unknown when it was lost."""
    return "unknown" if status is None else str(status)


def failure() -> str | None:
    """Why an engine that cannot serve stopped this master (after a restart), or None when none did."""
    return _FAILURES[0] if _FAILURES else None


def reap_engines_first(server: Any) -> None:
    """Make the master's reaping (gunicorn's arbiter, ``server``) collect the engines' ends before it takes every
    ended child with ``waitpid(-1)``, which would lose their status (see the module docstring)."""
    reap_workers = getattr(server, "reap_workers", None)
    if not callable(reap_workers):
        return

    def reap_engines_then_workers() -> None:
        for engine in _ENGINES:
            engine.collect()
        reap_workers()

    server.reap_workers = reap_engines_then_workers


def start_engines(count: int, control_dir: Path, on_death: Callable[[int], None], stall_s: float) -> list[Engine]:
    """``count`` engines, slots 0..count-1, unless this master runs them already (a HUP executes the config
    again), each killed and restarted once silent for ``stall_s`` (STALL_S; 0: never) or once its state answer says a
    batch has run past it. A kept CONTROL_DIR's stale files are gone by then (gunicorn.conf.py's on_starting:
    control.clear_stale)."""
    if _ENGINES:
        return _ENGINES
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    _ENGINES.extend(Engine(slot, control_dir, on_death, stall_s).start() for slot in range(count))
    return _ENGINES


def stop_engines(timeout_s: float) -> None:
    """Stop every engine: all signalled first, then each waited for."""
    for engine in _ENGINES:
        engine.signal_stop()
    for engine in _ENGINES:
        engine.wait_stopped(timeout_s)
    _ENGINES.clear()
