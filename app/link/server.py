"""The engine process: ``python -m app.link.server SLOT``, started and restarted by the gunicorn master
(app/link/supervisor.py), ENGINES_PER_DEVICE per GPU (on a CPU host, that many on the CPU). It owns the loaded
versions, the reconcile, rollouts, the monitor, batching, decoding and the forward pass (``Service``), served to the
HTTP workers over a Unix socket in CONTROL_DIR (app/link/wire.py, reached through app/link/client.py) by the event
loop of app/link/loop.py.

Before it listens it loads its models; a model that cannot be served ends it with status 3 and its reason in
``engine-<slot>.failed``, which the HTTP workers read to stop the server with that message. SIGTERM (from the
master, after the HTTP workers) finishes what is queued and exits; so does the master's end (its pipe closes).
"""
from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import torch

from app.config import Settings, load_settings
from app.engine.service import Service
from app.engine.versions.sources import DirectorySource
from app.hosting import control
from app.hosting.drain import exit_now
from app.link.loop import EngineServer
from app.metrics import ENGINE_STARTS, ENGINE_UP

log = logging.getLogger(__name__)
BOOT_ERROR = 3  # as a gunicorn worker's boot error: the master stops instead of restarting it


def _serve_forever(settings: Settings, slot: int) -> None:
    control_dir = settings.control_dir
    assert control_dir is not None, "the engine process needs CONTROL_DIR (gunicorn.conf.py sets it)"
    # What start-up imported (torch, the settings) lives as long as the process: frozen out of the collector's scans,
    # which every few thousand requests would otherwise walk all of it. Frozen before the models load: a version
    # retired later is collected without thawing it all (app/engine/versions/apply.py, ``_collect_retired``)
    gc.freeze()
    try:
        service = Service.build(settings, DirectorySource(settings))
        server = EngineServer(service, control.socket_path(control_dir, slot))
        server.bind()
    except Exception as exc:  # noqa: BLE001 - said once, in the log and for the HTTP workers
        _fail(control_dir, slot, getattr(exc, "message", None) or str(exc))
    control.engine_failure(control_dir, slot).unlink(missing_ok=True)
    ENGINE_UP.labels(str(slot)).set(1)
    # The stop waits for the batches queued: on a thread of its own, while the loop (this thread) sends their answers
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=_stop, args=(server, settings),
                                                             name="engine-stop").start())
    server.listen()


def _fail(control_dir: Path, slot: int, message: str) -> None:
    """Say why this engine cannot serve (for the HTTP workers and the master) and exit with the boot error."""
    log.error("cannot serve the model: %s", message)
    failure = control.engine_failure(control_dir, slot)
    partial = failure.with_name(f".{failure.name}.{os.getpid()}")
    partial.write_text(message, encoding="utf-8")
    partial.replace(failure)  # whole or not there: a worker may read it at any moment
    exit_now(SystemExit(BOOT_ERROR))


def _exit_with_the_master() -> None:
    """The master holds this process's stdin: at its end (the master died without stopping it) exit, instead of
    holding the GPU for no one."""
    def watch() -> None:
        sys.stdin.buffer.read()
        log.warning("the master is gone: the engine exits")
        exit_now(SystemExit(0))
    threading.Thread(target=watch, name="master-watch", daemon=True).start()


def _stop(server: EngineServer, settings: Settings) -> None:
    """SIGTERM from the master (after the HTTP workers drained): finish what is queued, write what was counted,
    then exit."""
    ENGINE_UP.labels(str(settings.worker_slot)).set(0)
    server.stop(settings.graceful_timeout_s)
    exit_now(SystemExit(0))


def engine_device(setting: str, slot: int, engines_per_device: int) -> str:
    """The device engine ``slot`` serves on, for DEVICE=``setting``: ``auto``/``cuda`` spread over the GPUs the driver
    lists, as the master counted its engines (``engines_per_device`` on each in turn). ``auto`` is CUDA when this
    torch can use it, else the CPU: a host whose driver lists GPUs that this torch cannot use (a CPU build, a driver
    older than its CUDA) serves on the CPU, and says why."""
    from app.hosting.host import placed_device, visible_gpus

    gpus = visible_gpus() if setting != "cpu" else 0
    if setting == "auto" and gpus and not torch.cuda.is_available():
        built = "a CPU build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        log.warning("DEVICE=auto: the driver lists %d GPU%s but torch %s (%s) cannot use CUDA: engine %d serves on "
                    "the CPU", gpus, "s" if gpus != 1 else "", torch.__version__, built, slot)
        return "cpu"
    return placed_device(setting, slot, gpus, engines_per_device)


def main(argv: list[str] | None = None) -> None:
    """Run engine ``SLOT`` (its GPU follows from it) until the master stops it."""
    from app.logs import configure_logging
    from models.data.malloc import keep_freed_memory

    args = sys.argv[1:] if argv is None else argv
    slot = int(args[0]) if args else 0
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the master's to handle: it stops the engines after
    _exit_with_the_master()
    settings = load_settings()
    configure_logging(settings.log_level, settings.access_log)
    keep_freed_memory(settings.malloc_trim_threshold_mb, settings.malloc_arena_max)
    device = engine_device(settings.device, slot, settings.engines_per_device)
    settings = settings.model_copy(update={"device": device, "worker_slot": slot})
    ENGINE_STARTS.labels(str(slot)).inc()
    _serve_forever(settings, slot)


if __name__ == "__main__":
    main()
