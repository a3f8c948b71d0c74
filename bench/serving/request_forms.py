"""``python -m bench.serving.request_forms``: what each form of POST /predict costs the server, in one run.

1. In process: reading one image out of a request (``app.v1.payload.parse_predict`` on a werkzeug request built
   from the bytes a client sends) for a raw body, multipart and JSON with base64, over the benchmark's photos; and the
   JSON form read the way the service read it before (the standard library's ``json`` and ``base64``), for the
   difference. Median of rounds, ms per image.
2. The server with its defaults (EfficientNet-Lite0), the same photos as a raw body and as JSON at C=16, in
   alternating rounds: images/s, p50 and the server's CPU per image.
Writes bench/results/<date>-request-forms-cpu-<cores>cpu-vm.md and prints it.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
import time
from typing import Callable

from werkzeug.test import EnvironBuilder
from werkzeug.wrappers import Request

from app.v1.payload import parse_predict
from bench.paths import WORK
from bench.serving.compare import export_models
from bench.serving.load import LoadResult, measure
from bench.serving.report import save_result
from harness.photos import workload
from harness.servers import visionserve

MB = 1 << 20


def json_body(image: bytes) -> bytes:
    """The JSON form of one image, as a client sends it."""
    return json.dumps({"images": [base64.b64encode(image).decode()]}).encode()


def _request(body: bytes, content_type: str) -> Request:
    environ = EnvironBuilder(method="POST", path="/predict", data=body, content_type=content_type).get_environ()
    request = Request(environ)
    request.max_content_length = 64 * MB
    return request


def _multipart(image: bytes) -> Request:
    builder = EnvironBuilder(method="POST", path="/predict", data={"image": (io.BytesIO(image), "photo.jpg")})
    request = Request(builder.get_environ())
    request.max_content_length = 64 * MB
    return request


def _standard_library_json(request: Request) -> list[bytes]:
    """The JSON form as read before: json.loads, then base64.b64decode(validate=True) per image."""
    return [base64.b64decode(text, validate=True) for text in json.loads(request.get_data())["images"]]


def _served_parse(request: Request) -> list[bytes]:
    return parse_predict(request, request.args.to_dict(), default_top_k=5, num_classes=1000, max_images=16).images


def parse_ms(rounds: int) -> dict[str, float]:
    """Median ms per image to read the image out of each request form."""
    photos = list(workload())
    forms: dict[str, tuple[Callable[[bytes], Request], Callable[[Request], list[bytes]]]] = {
        "raw body": (lambda image: _request(image, "image/jpeg"), _served_parse),
        "multipart": (_multipart, _served_parse),
        "JSON + base64": (lambda image: _request(json_body(image), "application/json"), _served_parse),
        "JSON + base64, standard library (before)": (lambda image: _request(json_body(image), "application/json"),
                                                     _standard_library_json)}
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(rounds):
        for name, (build, read) in forms.items():
            requests = [build(image) for image in photos]  # built outside the timing: the client's work
            started = time.perf_counter()
            for request, image in zip(requests, photos):
                assert read(request) == [image]
            times[name].append(1000 * (time.perf_counter() - started) / len(photos))
    return {name: statistics.median(values) for name, values in times.items()}


def served(duration_s: float, rounds: int) -> dict[str, list[LoadResult]]:
    """The server with its defaults: raw and JSON bodies at C=16, alternating."""
    weights = export_models(WORK / "weights", ["efficientnet_lite0"])["efficientnet_lite0"]
    logs = WORK / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    bodies = {"raw body": (list(workload()), "image/jpeg"),
              "JSON + base64": ([json_body(image) for image in workload()], "application/json")}
    results: dict[str, list[LoadResult]] = {name: [] for name in bodies}
    server = visionserve(weights, logs).wait_ready()
    try:
        for _ in range(rounds):
            for name, (payloads, content_type) in bodies.items():
                results[name].append(measure(name, "efficientnet_lite0", server.url, "/predict", payloads, 16,
                                             duration_s, 2.0, content_type=content_type,
                                             server_pid=server.process.pid))
    finally:
        server.stop()
    return results


def report(parse: dict[str, float], server: dict[str, list[LoadResult]], rounds: int) -> str:
    """The figures as markdown."""
    def median(points: list[LoadResult], key: str) -> float:
        return statistics.median(getattr(p, key) or 0.0 for p in points)

    lines = ["# What each request form costs the server", "",
             "`python -m bench.serving.request_forms`: reading the image out of a request, in process, ms per image "
             "(median over the benchmark's 18 photos, 34 KB to 1.1 MB of JPEG):", "",
             "| form | ms per image |", "| --- | ---: |"]
    lines += [f"| {name} | {ms:.3f} |" for name, ms in parse.items()]
    lines += ["", f"The server with its defaults, EfficientNet-Lite0, C=16, median of {rounds} alternating rounds:",
              "", "| form | img/s | p50 ms | p99 ms | server CPU ms/img |", "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {name} | {median(points, 'images_per_s'):.1f} | {median(points, 'p50_ms'):.0f} | "
              f"{median(points, 'p99_ms'):.0f} | {median(points, 'cpu_ms_per_image'):.1f} |"
              for name, points in server.items()]
    raw, as_json = (median(server[name], "cpu_ms_per_image") for name in ("raw body", "JSON + base64"))
    before = parse["JSON + base64, standard library (before)"]
    lines += ["", f"JSON costs the server {as_json - raw:+.1f} ms of CPU per image more than a raw body "
              f"({as_json / raw:.2f}x) in this run; reading it in process takes {parse['JSON + base64']:.2f} ms per "
              f"image against {before:.2f} ms the way it was read before ({before / parse['JSON + base64']:.1f}x)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per server point")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (in process: 5x this)")
    args = parser.parse_args(argv)
    parse = parse_ms(5 * args.rounds)
    print(parse, flush=True)
    save_result("request-forms", report(parse, served(args.duration, args.rounds), args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
