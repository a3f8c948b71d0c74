"""The service's own request path in process: what it costs per image with no HTTP and no other request.

    python -m bench.serving.request_path --weights weights  # CPU ms per image, split into decode, forward, rest

The WSGI app ``create_app`` builds, with a gunicorn worker's settings (its share of the cores for the forward pass,
its glibc tuning, the multiprocess metrics of a server with several workers, every batch through the queue and
the batch worker's thread as under load rather than run on the request's thread as a lone request is), is called
directly, one request at a time, with the benchmark's photos: no socket, no HTTP parsing, no other request. The
process's CPU time per answered image, split by the server's own stage counters (decode + preprocess; the forward
pass with its batch's collation, softmax and monitor; the rest), estimates the least a server running this path
pays per image: under load it adds HTTP, the kernel's socket copies and two busy cores sharing their caches, and
saves a little in the forward pass when requests batch. ``cores / cpu_ms_per_image`` is then about the most such a
server could serve, to set beside the CPU-time bound of bench/serving/limit.py, which times decode and forward
alone with warm caches and no Python around them. The forward share is the batch thread's CPU time, as in the
server: with more than one forward thread (hosts of 32 cores and more) the other threads' time counts as the rest.

It runs in a spawned process: the app sets the process's torch threads (the worker's share), which the ceiling
measured afterwards in the benchmark's own process must not inherit.
"""
from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

ROUNDS = 6  # timed passes over the photos: about 2 s of CPU for Lite0's 18 photos here


@dataclass(frozen=True)
class RequestPathResult:
    """CPU per image of the request path in process, and the server's stage counters' share of it."""

    cpu_ms_per_image: float  # the whole process (request, batch worker and every other thread) per image answered
    decode_ms: float  # decode + preprocess (the decode stage's counter: the request thread's, and the batch's where
    # the device path decodes it)
    forward_ms: float  # the forward pass and its softmax (the forward stage's counter; the batch's collation and the
    # monitor are in the rest: the inference stage's counter would count a batch's decode twice on the device path)
    images: int  # images the timed passes answered (the batch-size counter's sum)

    @property
    def rest_ms(self) -> float:
        """Routing, parsing, Flask, metrics, the batch's collation, the monitor, the answer and the hand-offs: what is
        neither decode nor forward."""
        return self.cpu_ms_per_image - self.decode_ms - self.forward_ms

    def images_per_s(self, cores: int) -> float:
        """About the most a server running this path could serve with ``cores`` fully busy."""
        return cores * 1000 / self.cpu_ms_per_image


def wsgi_environ(body: bytes, content_type: str | None = None, path: str = "/predict", method: str = "POST",
                 headers: Sequence[tuple[str, str]] = ()) -> dict[str, object]:
    """The WSGI environ a server makes of one request (``headers``: its header fields, Content-Type among them or
    in ``content_type``), for calling an app directly."""
    environ: dict[str, object] = {
        "REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": "", "SERVER_NAME": "127.0.0.1",
        "SERVER_PORT": "8000", "SERVER_PROTOCOL": "HTTP/1.1", "REMOTE_ADDR": "127.0.0.1",
        "CONTENT_LENGTH": str(len(body)), "wsgi.input": io.BytesIO(body), "wsgi.url_scheme": "http",
        "wsgi.errors": io.StringIO(), "wsgi.version": (1, 0), "wsgi.multithread": True, "wsgi.multiprocess": True,
        "wsgi.run_once": False, "wsgi.input_terminated": True}  # gunicorn ends a request's body itself
    if content_type is not None:
        environ["CONTENT_TYPE"] = content_type
    for name, value in headers:
        key = name.upper().replace("-", "_")
        environ[key if key in ("CONTENT_TYPE", "CONTENT_LENGTH") else f"HTTP_{key}"] = value
    return environ


def _counters() -> dict[str, float]:
    """This process's images run and CPU seconds per stage, from the server's own metrics."""
    from prometheus_client import REGISTRY

    from harness.servers import metric_sum  # (over the versions' series)

    return {"images": metric_sum(REGISTRY, "visionserve_batch_size_sum"),
            **{stage: metric_sum(REGISTRY, "visionserve_stage_cpu_seconds_total", stage=stage)
               for stage in ("decode", "forward")}}


def _measure(weights: Path, workers: int, bodies: Sequence[bytes], content_type: str, rounds: int,
             results: "multiprocessing.Queue[dict[str, float] | str]") -> None:
    """In the spawned process: build the app as a gunicorn worker would, then time ``rounds`` passes over
    ``bodies`` after one untimed pass."""
    with tempfile.TemporaryDirectory(prefix="visionserve-request-path-") as metrics_dir:
        # Set before anything imports prometheus_client: a server with several workers writes its metrics here.
        os.environ.update({"PROMETHEUS_MULTIPROC_DIR": metrics_dir, "VISIONSERVE_WEIGHTS_DIR": str(weights),
                           "VISIONSERVE_DEVICE": "cpu", "VISIONSERVE_WORKERS": str(workers),
                           "VISIONSERVE_INLINE_WHEN_IDLE": "false", "VISIONSERVE_LOG_LEVEL": "warning"})
        try:
            results.put(_timed_passes(bodies, content_type, rounds))
        except Exception as exc:  # noqa: BLE001 - said to the parent instead of a traceback it never reads
            results.put(f"{type(exc).__name__}: {exc}")


def _timed_passes(bodies: Sequence[bytes], content_type: str, rounds: int) -> dict[str, float]:
    from app import EXTENSION_KEY
    from app.factory import create_app

    app = create_app()

    def post(body: bytes) -> None:
        statuses: list[str] = []
        answer = app(wsgi_environ(body, content_type), lambda status, headers, *_: statuses.append(status))
        try:
            b"".join(answer)
        finally:
            getattr(answer, "close", lambda: None)()
        if statuses[0] != "200 OK":
            raise RuntimeError(f"the app answered {statuses[0]}")

    def counted() -> dict[str, float]:  # the batches' figures written first (METRICS_FLUSH_MS), as a scrape has
        app.extensions[EXTENSION_KEY].catalog.settle_figures()
        return _counters()

    try:
        for body in bodies:
            post(body)
        before, cpu_started = counted(), time.process_time()
        for _ in range(rounds):
            for body in bodies:
                post(body)
        cpu_s, after = time.process_time() - cpu_started, counted()
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)
    images = after["images"] - before["images"]
    return {"cpu_ms_per_image": 1000 * cpu_s / images, "images": int(images),
            "decode_ms": 1000 * (after["decode"] - before["decode"]) / images,
            "forward_ms": 1000 * (after["forward"] - before["forward"]) / images}


def request_path(weights: Path, workers: int, bodies: Sequence[bytes], content_type: str = "application/json",
                 rounds: int = ROUNDS, timeout_s: float = 600) -> RequestPathResult:
    """The request path's CPU per image over ``rounds`` passes of ``bodies``, in a process of its own with the
    settings of one of ``workers`` gunicorn workers."""
    # Imported here, not at the top: the spawned process imports this module, and must not import the app's
    # modules (prometheus_client among them) before it has set their environment.
    from bench.serving.limit import next_report

    context = multiprocessing.get_context("spawn")  # never fork a process that has run torch
    results = context.Queue()
    process = context.Process(target=_measure, args=(weights, workers, list(bodies), content_type, rounds, results))
    process.start()
    try:
        found = next_report(results, [process], timeout_s)
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

    from app.hosting.host import workers_for
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
    """The figures in words, for the command."""
    return (f"{result.cpu_ms_per_image:.1f} ms CPU per image = decode {result.decode_ms:.1f} + forward "
            f"{result.forward_ms:.1f} + the rest {result.rest_ms:.1f}, so about {result.images_per_s(cores):.1f} "
            f"img/s at most on {cores} cores")


if __name__ == "__main__":
    main()
