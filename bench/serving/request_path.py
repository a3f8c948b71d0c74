"""The service's own request path in process: the bound on what any HTTP front and any concurrency could reach.

    python -m bench.serving.request_path --weights weights  # CPU ms per image, split into decode, forward, rest

The WSGI app ``create_app`` builds (the served weights, a gunicorn worker's settings: its share of the cores for
the forward pass, its glibc tuning) is called directly, one base64 JSON request at a time, with the benchmark's
photos: no socket, no HTTP parsing, no other request. The process's CPU time per answered image, and the server's
own stage counters (decode + preprocess, forward pass), say what the request path itself costs against the
CPU-time bound of bench/serving/limit.py, which times decode and forward alone with warm caches. With every core
busy, a server running this path cannot serve more than ``cores / cpu_ms_per_image`` images per second.

It runs in a spawned process: the app sets the process's torch threads (the worker's share), which the ceiling
measured afterwards in the benchmark's own process must not inherit.
"""
from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence


ROUNDS = 6  # timed passes over the photos: about 2 s of CPU for Lite0's 18 photos here


@dataclass(frozen=True)
class RequestPathResult:
    """CPU per image of the request path in process, and the server's stage counters' share of it."""

    cpu_ms_per_image: float  # the whole process (request, batch worker and every other thread) per answered image
    decode_ms: float  # decode + preprocess (the request thread's stage counter)
    forward_ms: float  # the forward pass with its batch's collation, softmax and monitor (the batch's counter)
    images: int

    @property
    def rest_ms(self) -> float:
        """Routing, parsing, Flask, metrics, the answer and the hand-offs: what is neither decode nor forward."""
        return self.cpu_ms_per_image - self.decode_ms - self.forward_ms

    def images_per_s(self, cores: int) -> float:
        """The most a server running this path could serve with ``cores`` fully busy."""
        return cores * 1000 / self.cpu_ms_per_image


def _environ(body: bytes, content_type: str) -> dict[str, object]:
    return {"REQUEST_METHOD": "POST", "PATH_INFO": "/predict", "QUERY_STRING": "", "SERVER_NAME": "127.0.0.1",
            "SERVER_PORT": "8000", "SERVER_PROTOCOL": "HTTP/1.1", "REMOTE_ADDR": "127.0.0.1",
            "CONTENT_TYPE": content_type, "CONTENT_LENGTH": str(len(body)), "wsgi.input": io.BytesIO(body),
            "wsgi.url_scheme": "http", "wsgi.errors": io.StringIO(), "wsgi.version": (1, 0),
            "wsgi.multithread": True, "wsgi.multiprocess": True, "wsgi.run_once": False}


def _stage_cpu_s() -> dict[str, float]:
    from app.metrics import STAGE_CPU_SECONDS

    return {stage: STAGE_CPU_SECONDS.labels(stage)._value.get() for stage in ("decode", "inference")}


def _measure(weights: Path, workers: int, bodies: Sequence[bytes], content_type: str, rounds: int,
             results: "multiprocessing.Queue[dict[str, float] | str]") -> None:
    """In the spawned process: build the app as a gunicorn worker would, then time ``rounds`` passes over
    ``bodies`` after one untimed pass."""
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)  # one process: the plain in-memory counters
    os.environ.update({"VISIONSERVE_WEIGHTS_DIR": str(weights), "VISIONSERVE_DEVICE": "cpu",
                       "VISIONSERVE_WORKERS": str(workers), "VISIONSERVE_LOG_LEVEL": "warning"})
    from app import EXTENSION_KEY, create_app

    app = create_app()

    def post(body: bytes) -> None:
        statuses: list[str] = []
        answer = app(_environ(body, content_type), lambda status, headers, *_: statuses.append(status))
        b"".join(answer)
        if statuses[0] != "200 OK":
            raise RuntimeError(f"the app answered {statuses[0]}")

    try:
        for body in bodies:
            post(body)
        stages, cpu_started = _stage_cpu_s(), time.process_time()
        for _ in range(rounds):
            for body in bodies:
                post(body)
        cpu_s, after = time.process_time() - cpu_started, _stage_cpu_s()
        images = rounds * len(bodies)
        results.put({"cpu_ms_per_image": 1000 * cpu_s / images, "images": images,
                     "decode_ms": 1000 * (after["decode"] - stages["decode"]) / images,
                     "forward_ms": 1000 * (after["inference"] - stages["inference"]) / images})
    except Exception as exc:  # noqa: BLE001 - said to the parent instead of a silent exit
        results.put(f"{type(exc).__name__}: {exc}")
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def request_path(weights: Path, workers: int, bodies: Sequence[bytes], content_type: str = "application/json",
                 rounds: int = ROUNDS, timeout_s: float = 600) -> RequestPathResult:
    """The request path's CPU per image over ``rounds`` passes of ``bodies``, in a process of its own with the
    settings of one of ``workers`` gunicorn workers."""
    context = multiprocessing.get_context("spawn")  # never fork a process that has run torch
    results = context.Queue()
    process = context.Process(target=_measure, args=(weights, workers, list(bodies), content_type, rounds, results))
    process.start()
    try:
        found = results.get(timeout=timeout_s)
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
    if isinstance(found, str):
        raise RuntimeError(f"the request path could not be measured: {found}")
    return RequestPathResult(**found)


def main() -> None:
    """Print the request path's CPU per image for the benchmark's photos as base64 JSON requests, against the
    CPU-time bound measured right after it."""
    import torch

    from app.host import workers_for
    from bench.serving.limit import configurations, cpu_time_bound
    from harness.photos import json_bodies, workload

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", type=Path, default=Path("weights"))
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="timed passes over the photos")
    args = parser.parse_args()
    result = request_path(args.weights, workers_for(0, "cpu")[0], json_bodies(workload()), rounds=args.rounds)
    predictor, configs = configurations(args.weights, compile_too=False)
    ceiling = cpu_time_bound(predictor, configs, workload())
    cores = torch.get_num_threads()
    print(asdict(result))
    print(f"request path in process: {describe(result, cores)}; the ceiling: {ceiling.images_per_s:.1f} img/s "
          f"(decode {ceiling.decode_ms:.1f} + forward {ceiling.single_ms:.1f} ms per image), so the path is "
          f"{result.images_per_s(cores) / ceiling.images_per_s:.2f} of it")


def describe(result: RequestPathResult, cores: int) -> str:
    """The figures in words, for the command and the benchmark's report."""
    return (f"{result.cpu_ms_per_image:.1f} ms CPU per image = decode {result.decode_ms:.1f} + forward "
            f"{result.forward_ms:.1f} + the rest {result.rest_ms:.1f}, so at most {result.images_per_s(cores):.1f} "
            f"img/s on {cores} cores")


if __name__ == "__main__":
    main()
