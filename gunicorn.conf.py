"""gunicorn settings, all taken from the same Settings object as the app (VISIONSERVE_* variables).

The master never imports torch or touches CUDA: forked workers would inherit a broken CUDA context. Each worker
loads the model itself (no preload_app), and its gthread pool lets concurrent requests share one batcher.
"""
import contextlib
import logging
import os
import sys
from pathlib import Path

from gunicorn.errors import HaltServer

from app import EXTENSION_KEY
from app.hosting import drain
from app.config import SettingsError, load_settings, unknown_variables
from app.hosting import control, owned_dirs
from app.engine.versions.desired import kept_from_an_earlier_run
from app.hosting.host import (address_in_use, bind_problem, engine_count, engine_mode, unserved_engines, workers_for,
                              workers_past_cores)
from app.logs import JsonFormatter, configure_access_log
from app.link import supervisor
from app.hosting.request_framing import ReadLimits

try:
    _settings = load_settings()
except SettingsError as exc:  # one line that says what to fix, not a traceback: JSON, as every line on stderr
    print(JsonFormatter().format(logging.LogRecord("gunicorn.error", logging.ERROR, __file__, 0,
                                                   "visionserve: bad setting: %s", (exc,), None)), file=sys.stderr)
    sys.exit(1)

# WORKERS=0 (the default): as many as the host uses well (app/hosting/host.py). The workers read the number chosen (each
# forward pass takes half of its worker's share of the cores).
_workers, _workers_why = workers_for(_settings.workers, _settings.device)
os.environ["VISIONSERVE_WORKERS"] = str(_workers)

# ENGINE=process: the models run in engine processes the master starts (app/link/supervisor.py), the workers only
# HTTP; ENGINE=auto is process with a GPU, inline on a CPU host (app/hosting/host.py says why).
_engine = engine_mode(_settings.engine, _settings.device)
# The engines read how many of them share the host (each forward pass takes its share of the cores).
_engines = engine_count(_settings.device, _settings.engines_per_device) if _engine == "process" else 0
# the server's own variables, given by hand: said at start (before, overwritten in silence; a trial). A USR2's new
# master inherits its predecessor's ENGINES, the count it makes again.
_given_by_hand = [f"{name}={os.environ[name]}" for name in ("VISIONSERVE_ENGINES", "VISIONSERVE_WORKER_SLOT")
                  if name in os.environ and not (name == "VISIONSERVE_ENGINES" and os.environ[name] == str(_engines))]
os.environ["VISIONSERVE_ENGINES"] = str(_engines)

# Several processes: prometheus-client's multiprocess mode, so /metrics on any worker reports all of them (the
# engines' batches included). The variable must be set before the workers import prometheus_client, i.e. here in
# the master before the fork.
# The directories this master makes are kept in app/hosting/owned_dirs.py (a HUP executes this file again); USR2's new
# master is handed this one (pre_exec), which it adopts here, and makes a CONTROL_DIR of its own.
owned_dirs.adopt(os.environ)
if (_workers > 1 or _engine == "process") and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = owned_dirs.make(owned_dirs.METRICS_PREFIX)
# What the master folds an ended process's values with (_forget), imported now: once the directory is set (prometheus-
# client picks its values' kind at its import, which the workers inherit), and never as a worker ends, when another
# release may lie where this one was read (its code swapped in place for a USR2, or back for a rollback), which this
# master cannot import (an ImportError ended a rolled-back master's stop).
_metrics_files = _multiprocess = None
if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    from prometheus_client import multiprocess as _multiprocess

    from app.hosting import metrics_files as _metrics_files

# The workers share repository loads and unloads through a directory (app/engine/versions/desired.py), made here
# before the fork so every worker of this master, and every worker it starts later, finds the same one.
if _settings.control_dir is None and not os.environ.get("VISIONSERVE_CONTROL_DIR"):
    os.environ["VISIONSERVE_CONTROL_DIR"] = owned_dirs.make(owned_dirs.CONTROL_PREFIX)

bind = _settings.bind
workers = _workers
worker_class = "app.hosting.worker.BufferingWorker"  # gthread, with each request read in its event loop
threads = _settings.threads
worker_connections = _settings.max_connections
timeout = _settings.timeout_s
graceful_timeout = _settings.graceful_timeout_s
keepalive = _settings.keepalive_s
preload_app = False
loglevel = _settings.log_level
accesslog = None  # the app writes one structured line per request itself
logger_class = "app.hosting.worker.NoAccessLog"  # and gunicorn builds no access line for no one
errorlog = "-"
# gunicorn's control socket (gunicornc -s PATH) in this server's CONTROL_DIR: its default, one path per user
# ($HOME/.gunicorn/gunicorn.ctl), was taken over by each server started on the machine and removed by the first to stop
control_socket = str(Path(os.environ["VISIONSERVE_CONTROL_DIR"]) / "gunicorn.ctl")
# gunicorn's own lines in the app's JSON format (app/logs.py), so every line of the output parses alike.
_level = _settings.log_level.upper()
logconfig_dict = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"json": {"()": "app.logs.JsonFormatter"}},
    "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}},
    "root": {"level": _level, "handlers": ["stderr"]},
    "loggers": {"gunicorn.error": {"level": _level, "handlers": ["stderr"], "propagate": False},
                # the app logs each request itself (visionserve.access, JSON with its id and stages)
                "gunicorn.access": {"level": "CRITICAL", "handlers": [], "propagate": False}},
}
configure_access_log(_settings.access_log)  # (ACCESS_LOG) inherited by the workers: their lines before the app loads
# Bound the request line and headers (a longer request line is refused by the worker's loop, 414, as a head over
# MAX_HEADER_BYTES is, 431: app/hosting/request_framing.py). One header may take the whole head: gunicorn's own bound
# on a header line (8190 bytes by default, 431 in its words) refused a large cookie or token within MAX_HEADER_BYTES.
limit_request_line = 8190
limit_request_fields = 100
limit_request_field_size = _settings.max_header_bytes


def _service(worker):  # noqa: ANN001, ANN202 - gunicorn passes its own worker object
    app = getattr(worker, "wsgi", None)
    return getattr(app, "extensions", {}).get(EXTENSION_KEY)


def on_starting(server) -> None:  # noqa: ANN001
    """Say so when a VISIONSERVE_ variable is no setting: a misspelt one would otherwise change nothing. Clear what
    an earlier run left in kept directories (CONTROL_DIR's marks, the metrics' files), then start the engines."""
    for warning in unknown_variables(os.environ):
        server.log.warning(warning)
    if _given_by_hand:
        server.log.warning("visionserve: %s: the server sets these itself (the engine count from ENGINE and "
                           "ENGINES_PER_DEVICE, each worker's slot): the values given are not used",
                           ", ".join(_given_by_hand))
    # its directories removed however it exits (a refusal below, a halt after on_exit, gunicorn's own exit when it
    # cannot listen), in this master only (its pid now: after a --daemon fork), not in the workers it forks
    owned_dirs.remove_at_exit()
    # and those of masters killed outright (SIGKILL, the OOM killer), which a restarted container's /tmp keeps
    if stale := owned_dirs.remove_stale():
        server.log.info("removed %d temporary directories of servers gone without removing them: %s", len(stale),
                        ", ".join(stale))
    refused = _start_refused(server)
    if refused is not None:
        server.log.error("visionserve: %s", refused)
        sys.exit(2)
    server.log.info("visionserve: %d worker%s (%s)", _workers, "" if _workers == 1 else "s", _workers_why)
    if (crowded := workers_past_cores(_workers, _engine)) is not None:
        server.log.warning("visionserve: %s", crowded)
    _say_auth(server)
    _halt_once(server)
    _refuse_ttou_at_one_worker(server)
    if not getattr(server, "master_pid", 0):  # a master started by another's USR2: the old workers' marks are live
        control.clear_stale(Path(os.environ["VISIONSERVE_CONTROL_DIR"]))  # a kept directory's: an earlier start's
        _say_kept_desired_state(server)
    _carry_over_from_predecessor(server)
    _tell_predecessor(server)
    _listen_again_once_promoted(server)
    _listen_again_after_a_rollback(server)
    _clear_metrics(server)
    chosen = "" if _settings.engine != "auto" else (" (ENGINE=auto: a GPU)" if _engine == "process" else
                                                     " (ENGINE=auto: no GPU in use)")
    if _engine == "inline":
        server.log.info("visionserve: the model runs in each HTTP worker, inline%s", chosen)
        if _settings.engines_per_device != 1:  # it would change nothing, and say nothing
            server.log.warning("visionserve: VISIONSERVE_ENGINES_PER_DEVICE=%d applies under ENGINE=process only: "
                               "set VISIONSERVE_ENGINE=process for engine processes", _settings.engines_per_device)
    if _engine == "process":
        server.log.info("visionserve: %d engine process%s (ENGINES_PER_DEVICE=%d)%s", _engines,
                        "" if _engines == 1 else "es", _settings.engines_per_device, chosen)
        unserved = unserved_engines(_workers, _engines)
        if unserved:
            server.log.warning("visionserve: %d of %d engines get no HTTP worker (worker n talks to engine n mod %d): "
                               "set VISIONSERVE_WORKERS to at least %d", unserved, _engines, _engines, _engines)
        supervisor.reap_engines_first(server)  # an engine's exit status is its watcher's to log, not lost to gunicorn
        _halt_when_an_engine_fails(server)
        supervisor.start_engines(_engines, Path(os.environ["VISIONSERVE_CONTROL_DIR"]),
                                 lambda pid: _forget(server, pid), _settings.stall_s)


def _say_auth(server) -> None:  # noqa: ANN001
    """Whether requests need the API key, and where it is read from, said once at start (an operator found it
    nowhere in the log; a trial). A key file that cannot be read is each worker's to say."""
    try:
        key, source = _settings.api_key_and_source()
    except OSError:
        return
    if key is None:
        server.log.info("visionserve: no API key: requests are served without one (VISIONSERVE_API_KEY or "
                        "VISIONSERVE_API_KEY_FILE requires one)")
        return
    server.log.info("visionserve: requests need the API key (from %s)%s", source,
                    "; health probes and /metrics are open (AUTH_HEALTH_OPEN)" if _settings.auth_health_open else "")


def nworkers_changed(server, new_value: int, old_value: int | None) -> None:  # noqa: ANN001
    """Keep the worker count VISIONSERVE_WORKERS set: readiness waits for that many workers' marks, and the engines,
    the queues and the cores each worker takes are sized by it, so gunicorn's TTIN and TTOU (one worker more or
    fewer) would leave /readyz 503 for good, or a worker no engine serves. Refused, and said how to change it."""
    if old_value is None or new_value == _workers:  # gunicorn's own setting of it at start (and a HUP's)
        return
    server._num_workers = _workers  # noqa: SLF001 - the count gunicorn's property just set, put back
    server.log.error("visionserve: a change of the worker count to %d (TTIN, TTOU) is refused: readiness, the "
                     "engines and the queues are sized by VISIONSERVE_WORKERS=%d; restart with the count you want "
                     "in VISIONSERVE_WORKERS", new_value, _workers)


def _start_refused(server) -> str | None:  # noqa: ANN001
    """Why this start cannot serve as its settings say, in one line naming what to set (then it stops, status 2),
    or None: an address it cannot listen on or that another server holds, gunicorn's own options beside the
    settings they stand for, a CONTROL_DIR or a PROMETHEUS_MULTIPROC_DIR that cannot be written."""
    inherited = os.environ.get("GUNICORN_FD") or os.environ.get("LISTEN_FDS")  # USR2's new master, systemd's sockets
    unusable = [] if inherited else [(address, why) for address in server.cfg.bind if (why := bind_problem(address))]
    if unusable:  # gunicorn would retry for 5 s, then say "Can't connect to ('garbage', 8000)"
        return (f"cannot listen on {unusable[0][0]}: {unusable[0][1]}; set VISIONSERVE_BIND to HOST:PORT (e.g. "
                "0.0.0.0:8000 or 127.0.0.1:8001)")
    taken = [] if inherited else [address for address in server.cfg.bind
                                  if address_in_use(address, server.cfg.reuse_port)]
    if taken:  # gunicorn would retry for 5 s, then say "Can't connect" with no hint of the setting
        return (f"{taken[0]} is in use (another server listens there): stop that server, or set VISIONSERVE_BIND to "
                "another address (e.g. 0.0.0.0:8001)")
    if server.cfg.workers != _workers:  # gunicorn's --workers or GUNICORN_CMD_ARGS, applied after this file
        return (f"gunicorn was told {server.cfg.workers} workers and VISIONSERVE_WORKERS says {_workers}: readiness "
                "waits for the workers the setting counts, and the engines and the queues are sized by it; set "
                f"VISIONSERVE_WORKERS={server.cfg.workers} instead of gunicorn's --workers")
    if over := _options_over_settings(server):
        option, variable, told, ours = over[0]
        return (f"gunicorn was told {option} {told} and {variable} says {ours}: the server sizes and checks what it "
                f"does by the setting (its queues, its shutdown against REQUEST_TIMEOUT_S); set {variable}={told} "
                f"instead of gunicorn's {option}")
    control_dir = os.environ["VISIONSERVE_CONTROL_DIR"]
    if (why_not := control.unwritable(Path(control_dir))) is not None:
        # under ENGINE=process each engine died writing there and was restarted without end
        return (f"VISIONSERVE_CONTROL_DIR {control_dir} cannot be written: {why_not}; every process of the server "
                "writes there (loads, readiness, rollouts): set it to a writable directory, or leave it unset for one "
                "of its own")
    metrics_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if metrics_dir and (why_not := control.unwritable(Path(metrics_dir))) is not None:  # (made when missing)
        # before: each worker stopped "cannot serve the model: [Errno 2] No such file or directory: .../histogram_
        # 1.db", naming neither the variable nor the fix (a trial)
        return (f"PROMETHEUS_MULTIPROC_DIR {metrics_dir} cannot be written: {why_not}; every process of the server "
                "writes its metrics there: set it to a writable directory, or leave it unset for one of its own")
    return None


# gunicorn's options that stand for a setting, beside --workers (-b stays gunicorn's to give: the address is checked
# as given); before, bin/serve --threads 2 or --graceful-timeout 5 started without a word, the queues sized by
# THREADS' 32 and the shutdown's check against REQUEST_TIMEOUT_S skipped (a misconfiguring operator's trial)
_SETTING_OPTIONS = {"threads": ("threads", "VISIONSERVE_THREADS"),
                    "worker_connections": ("max_connections", "VISIONSERVE_MAX_CONNECTIONS"),
                    "timeout": ("timeout_s", "VISIONSERVE_TIMEOUT_S"),
                    "graceful_timeout": ("graceful_timeout_s", "VISIONSERVE_GRACEFUL_TIMEOUT_S"),
                    "keepalive": ("keepalive_s", "VISIONSERVE_KEEPALIVE_S")}


def _options_over_settings(server) -> list[tuple[str, str, object, object]]:  # noqa: ANN001
    """gunicorn's options given beside the settings they stand for (on its command line or GUNICORN_CMD_ARGS,
    applied after this file), as (option, variable, what gunicorn was told, what the setting says)."""
    return [(server.cfg.settings[name].cli[-1], variable, getattr(server.cfg, name), getattr(_settings, setting))
            for name, (setting, variable) in _SETTING_OPTIONS.items()
            if getattr(server.cfg, name) != getattr(_settings, setting)]


def _say_kept_desired_state(server) -> None:  # noqa: ANN001
    """A CONTROL_DIR kept from an earlier run holds the models' desired state its calls and rollouts left (a default a
    promotion holds, a model a call unloaded): the workers serve it, not the repository's policies afresh, so the
    start says so (it said only the versions each model served: an upgrade trial)."""
    control_dir = Path(os.environ["VISIONSERVE_CONTROL_DIR"])
    kept = kept_from_an_earlier_run(control_dir)
    if kept is not None:
        server.log.info("visionserve: CONTROL_DIR keeps the models' desired state an earlier run left, which the "
                        "workers serve (%s); remove %s to start from the repository's policies", kept,
                        control_dir / control.DESIRED)


def _carry_over_from_predecessor(server) -> None:  # noqa: ANN001
    """USR2's new master, in a CONTROL_DIR it made itself: the desired state of the master that started it (what
    calls and rollouts changed), its versions' drift references and batch caps taken into it before any worker or
    engine starts, so they serve what the old master's served (a master given its predecessor's kept CONTROL_DIR
    shares them already)."""
    predecessor, mine = os.environ.get(control.PREDECESSOR_VARIABLE), os.environ["VISIONSERVE_CONTROL_DIR"]
    if not predecessor or Path(predecessor) == Path(mine) or not owned_dirs.made_here(mine):
        return
    try:
        copied = control.carry_over(Path(predecessor), Path(mine))
    except OSError as exc:
        server.log.warning("visionserve: the desired state of the master before (%s) could not be taken over (%s): "
                           "the workers serve the repository's policies afresh", predecessor, exc)
        return
    kept = kept_from_an_earlier_run(Path(mine)) if control.DESIRED in copied else None
    if kept is not None:
        server.log.info("visionserve: the models' desired state of the master before (%s) carried over, which the "
                        "workers serve (%s)", predecessor, kept)


def _listen_again_once_promoted(server) -> None:  # noqa: ANN001
    """A master a USR2 started, in its predecessor's CONTROL_DIR (one the operator keeps): the predecessor's stop
    removes gunicorn.ctl, where this master's control socket listens (gunicorn removes its socket's path whoever
    listens there now); so once this master is promoted (the old one gone), it listens there again."""
    if not getattr(server, "master_pid", 0):
        return
    promote = server.maybe_promote_master

    def maybe_promote_master() -> None:
        predecessor = server.master_pid
        promote()
        if predecessor and not server.master_pid:
            _listen_again(server, "the master before")

    server.maybe_promote_master = maybe_promote_master


def _listen_again_after_a_rollback(server) -> None:  # noqa: ANN001
    """The master a USR2 started beside this one, in the same CONTROL_DIR, stopped (an operator rolling back): its
    stop removed gunicorn.ctl, where this master's control socket listened, so once it is reaped this master listens
    there again (before, gunicornc reached no master until this one's next HUP or start: an upgrade trial)."""
    reap = getattr(server, "reap_workers", None)
    if not callable(reap):
        return

    def reap_workers() -> None:
        successor = getattr(server, "reexec_pid", 0)
        reap()
        if successor and not getattr(server, "reexec_pid", 0):
            _listen_again(server, "the master a USR2 started")

    server.reap_workers = reap_workers


def _listen_again(server, gone: str) -> None:  # noqa: ANN001
    """This master's control socket listening at gunicorn.ctl again where the ``gone`` master's stop removed it."""
    if not os.path.exists(control_socket):
        server._stop_control_server()
        server._start_control_server()
        server.log.info("visionserve: the control socket listens again at %s (%s removed it as it stopped)",
                        control_socket, gone)


def _clear_metrics(server) -> None:  # noqa: ANN001
    """Remove the values an earlier run left in PROMETHEUS_MULTIPROC_DIR (its ``*.db`` files, nothing else), as
    prometheus-client asks between runs: /metrics sums every file there, so a run that died uncleanly (the
    container killed) would add its processes' counters, a ready 0 and its queue capacity to this one's. Once, at
    the master's start: a HUP keeps the workers and engines, and their files; nor in a master started by another's
    USR2 (its ``master_pid``), whose workers still serve and write there."""
    folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not folder or getattr(server, "master_pid", 0):
        return
    left = list(Path(folder).glob("*.db"))
    for path in left:
        path.unlink(missing_ok=True)
    if left:
        server.log.info("visionserve: removed %d metrics file%s an earlier run left in %s", len(left),
                        "" if len(left) == 1 else "s", folder)


def _refuse_ttou_at_one_worker(server) -> None:  # noqa: ANN001
    """TTOU at one worker refused as at any other count (``nworkers_changed``), and said: gunicorn's own returns
    there without a word, and without calling the hook (before: TTIN logged its refusal, TTOU nothing)."""
    ttou = server.handle_ttou

    def handle_ttou() -> None:
        if server.num_workers <= 1:
            nworkers_changed(server, server.num_workers - 1, server.num_workers)
            return
        ttou()

    server.handle_ttou = handle_ttou


def _halt_once(server) -> None:  # noqa: ANN001
    """Make a worker's boot error halt the master once: while it stops, another worker that failed to boot too is
    one more worker reaped. gunicorn's arbiter raises HaltServer for each one it reaps, and its halt reaps the
    others: when two failed alike (each loads the same model) the second raised again from inside the halt, which
    ended the master with a plain traceback, status 1 instead of 3, and no on_exit (engines, temporary directories)."""
    reap, stop = server.reap_workers, server.stop
    stopping = False

    def reap_workers() -> None:
        while True:
            try:
                return reap()
            except HaltServer:  # the worker is reaped and logged ("exited with code 3"); reap the rest
                if not stopping:
                    raise

    def stop_reaping_quietly(graceful: bool = True) -> None:
        nonlocal stopping
        stopping = True
        stop(graceful)

    server.reap_workers, server.stop = reap_workers, stop_reaping_quietly


def _halt_when_an_engine_fails(server) -> None:  # noqa: ANN001
    """Make the SIGTERM an engine's watcher sends the master when the engine cannot serve after a restart
    (app/link/supervisor.py) halt it as a worker's boot error does: status 3 and the engine's reason. A plain stop
    exits 0, which systemd's Restart=on-failure, compose's on-failure and a Job take for a clean end."""
    handle_term = server.handle_term

    def handle_term_or_halt() -> None:
        reason = supervisor.failure()
        if reason is not None:
            raise HaltServer(reason, server.WORKER_BOOT_ERROR)
        handle_term()

    server.handle_term = handle_term_or_halt


def _forget(server, pid: int) -> None:  # noqa: ANN001
    """A worker or an engine ended: its report of what it served, a worker's marks of having reached the engine
    (readiness counts the live workers' marks) and of leaving, and its live gauges go; its counts are folded into
    the ended processes' (app/hosting/metrics_files.py). A directory that cannot be written
    (read-only, its disk gone) is said in the log, never raised: the master's loop would end with it, and the server
    with every worker."""
    control_dir = os.environ.get("VISIONSERVE_CONTROL_DIR")
    try:
        if control_dir:
            control.report(Path(control_dir), pid).unlink(missing_ok=True)
            control.ready_mark(Path(control_dir), pid).unlink(missing_ok=True)
            control.leaving_mark(Path(control_dir), pid).unlink(missing_ok=True)  # (killed during its drain)
            control.loading_mark(Path(control_dir), pid).unlink(missing_ok=True)  # (ended before it served)
        if _metrics_files is not None and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            _multiprocess.mark_process_dead(pid)
            try:
                _metrics_files.fold_ended(Path(os.environ["PROMETHEUS_MULTIPROC_DIR"]), pid)
            except Exception as exc:  # noqa: BLE001 - a file that does not read (cut short, overwritten): never the
                # master loop's end
                server.log.warning("visionserve: the metrics files of process %d could not be folded (%s): they stay "
                                   "as they are", pid, exc)
    except OSError as exc:
        server.log.warning("visionserve: what worker %d left in CONTROL_DIR or PROMETHEUS_MULTIPROC_DIR cannot be "
                           "removed (%s): readiness and /metrics may count it until it is", pid, exc)


def pre_fork(server, worker) -> None:  # noqa: ANN001
    """In the master: give the new worker the lowest number no live worker holds (its GPU follows from it)."""
    held = {getattr(other, "slot", None) for other in server.WORKERS.values()}
    worker.slot = next(slot for slot in range(len(held) + 1) if slot not in held)


def post_fork(server, worker) -> None:  # noqa: ANN001
    """The worker's number for the app (it picks its GPU with it), the limits its event loop enforces while a
    request arrives, and where the workers' ready marks are (app/hosting/worker.py)."""
    os.environ["VISIONSERVE_WORKER_SLOT"] = str(getattr(worker, "slot", 0))
    worker.limits = ReadLimits(_settings.client_header_timeout_s, _settings.client_body_timeout_s,
                               _settings.max_body_bytes, _settings.keepalive_linger_ms / 1000,
                               _settings.client_answer_timeout_s, worker.cfg.limit_request_line,
                               _settings.max_header_bytes, worker.cfg.limit_request_field_size,
                               _settings.client_body_min_rate, _settings.max_connections_per_client)
    worker.control_dir = Path(os.environ["VISIONSERVE_CONTROL_DIR"])  # the ready marks: which workers serve
    with contextlib.suppress(OSError):  # until it serves: a HUP's old worker answers on meanwhile (hosting/drain.py)
        control.loading_mark(worker.control_dir, os.getpid()).touch()
    worker.loop_requests = _engine == "process" and _settings.loop_requests  # inline: the threads run torch


def post_worker_init(worker) -> None:  # noqa: ANN001
    """SIGTERM drains with the listener open, then closes it with nothing left in its backlog (app/hosting/drain.py)."""
    drain.install(worker, _service, _settings.shutdown_drain_s, _settings.graceful_timeout_s - 1)


def worker_exit(server, worker) -> None:  # noqa: ANN001
    """After the worker's last request, finish queued inference and stop the batcher thread; then exit at once
    (app/hosting/drain.py: no interpreter teardown)."""
    service = _service(worker)
    if service is not None:
        service.shutdown(timeout=_settings.graceful_timeout_s)
    drain.exit_now(sys.exc_info()[1])  # gunicorn calls this hook on the worker's way out, its SystemExit in flight


def child_exit(server, worker) -> None:  # noqa: ANN001
    """Drop a dead worker's live gauges (queue depth, GPU memory) from the multiprocess metrics (its counts folded
    into the ended processes'), its report of what it served, and its mark of having reached the engine
    (``_forget``)."""
    _forget(server, worker.pid)


def _tell_predecessor(server) -> None:  # noqa: ANN001
    """USR2's new master: its CONTROL_DIR written into the old master's (``control.SUCCESSOR``), whose workers then
    leave new connections to this one's once these serve (while they drain, or their engines restart)."""
    predecessor, mine = os.environ.get(control.PREDECESSOR_VARIABLE), os.environ["VISIONSERVE_CONTROL_DIR"]
    if not predecessor or Path(predecessor) == Path(mine):
        return
    try:
        (Path(predecessor) / control.SUCCESSOR).write_text(mine, encoding="utf-8")
    except OSError as exc:
        server.log.warning("could not tell the master this one started beside where its workers are (%s): its "
                           "workers may take new connections once they drain, to answer 503", exc)


def pre_exec(server) -> None:  # noqa: ANN001
    """USR2's new master, just before gunicorn executes it: given no CONTROL_DIR of this master's (gunicorn passes it
    the environment it started with, which names it after a HUP), it makes its own: this one's engine sockets and
    workers' marks are in it, and this master removes it at its exit. The metrics directory this master made is
    handed over (app/hosting/owned_dirs.py): both masters' workers count in it, so the counters a scrape reads keep
    rising whichever master's worker answers it. It is told where this master's workers' ready marks are
    (``control.PREDECESSOR_VARIABLE``): its own workers leave new connections to them while these serve and they do
    not yet (they took them, to answer 503 while their engines loaded)."""
    owned_dirs.leave_out_of(server.cfg.env_orig)
    metrics_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if metrics_dir and owned_dirs.made_here(metrics_dir) and owned_dirs.hand_over(metrics_dir, server.cfg.env_orig):
        server.cfg.env_orig["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    server.cfg.env_orig[control.PREDECESSOR_VARIABLE] = os.environ["VISIONSERVE_CONTROL_DIR"]
    _on_the_release_s_own_environment(server)


def _on_the_release_s_own_environment(server) -> None:  # noqa: ANN001
    """USR2's new master as bin/serve would start the release now in the working directory: gunicorn executes the
    old master's interpreter again, so a release swapped in with a ``.venv`` of its own ran on the old release's
    packages (an upgrade trial); a master bin/serve started from the checkout's ``.venv`` has the new one's then."""
    args = server.START_CTX["args"]
    python = Path(server.START_CTX["cwd"]) / ".venv" / "bin" / "python"
    if len(args) > 1 and args[1] == ".venv/bin/gunicorn" and python.exists():
        server.START_CTX[0] = args[0] = str(python)


def on_exit(server) -> None:  # noqa: ANN001
    """Stop the engines once the workers are gone (they finish what is queued); the metrics and control directories
    this master made go at its exit, right after (ones set aside by ops are theirs to keep; the next start empties a
    metrics one of its ``*.db`` files: _clear_metrics; a metrics one handed to USR2's new master is that one's).
    A master halted by a worker that could not start says why last, after gunicorn's "Reason: Worker failed to
    boot.", where a reader of the log looks."""
    said = os.environ.get("VISIONSERVE_CONTROL_DIR")
    reason = control.boot_failure(Path(said), os.getpid()) if said else None
    if reason is not None:
        server.log.error("visionserve: did not start: %s", reason)
    supervisor.stop_engines(_settings.graceful_timeout_s)  # (its directories then go at its exit: on_starting)


