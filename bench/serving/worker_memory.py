"""What a server's processes hold in memory under a long mixed load: real photos from 64 to 1600 pixels a side at
several JPEG qualities, and the same as PNG, C clients for minutes (a quarter each sending a JPEG a request, 4 in
a multipart body, a JPEG in base64 JSON, a PNG), each process's resident memory read every ``--sample-s``; variants
of the settings side by side, rounds alternating them (the allocator's settings, MALLOC_ARENA_MAX and
MALLOC_TRIM_THRESHOLD_MB, are what it was written for: a soak's inline workers held 1.4-1.6 GB and went on growing).

    .venv/bin/python -m bench.serving.worker_memory                                      # inline, default vs glibc's
    .venv/bin/python -m bench.serving.worker_memory --engine process --seconds 600 --rounds 1
    .venv/bin/python -m bench.serving.worker_memory --variant "trim 0:MALLOC_TRIM_THRESHOLD_MB=0" --variant default

Each variant is ``NAME`` or ``NAME:SETTING=VALUE,...`` (settings without their VISIONSERVE_ prefix; ``default``:
none). Prints, for each variant and round, the requests answered a second and each process's resident memory at
the first sample after warm-up, its largest and its last (MB), its kind (worker, engine); a table to paste.
"""
from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import threading
import time
from pathlib import Path

from PIL import Image

from app.hosting.procstat import children, cpu_and_memory
from bench.serving.load import closed_loop
from bench.usage import engine_pids, process_tree_cpu
from harness.photos import PHOTO_NAMES, json_bodies, jpeg, photo, request_bodies
from harness.servers import visionserve

SIDES = (64, 160, 320, 640, 1024, 1600)  # a photo's longer side: thumbnails to phone photos scaled down
QUALITIES = (60, 80, 92)
WARM_UP_S = 30.0  # the first sample counted comes after it (the model's and the threads' first allocations)
FORMS = ("jpeg", "multipart x4", "json", "png")  # each a quarter of the clients
DEFAULT_VARIANTS = ("default", "glibc arenas:MALLOC_ARENA_MAX=0")


def scaled_photos() -> list[Image.Image]:
    """Every photo at every side, in a mixed order (neighbours differ in size)."""
    photos = [photo(name) for name in PHOTO_NAMES]
    made = [image.resize((max(1, round(image.width * side / max(image.size))),
                          max(1, round(image.height * side / max(image.size)))))
            for side in SIDES for image in photos]
    return made[::2] + made[1::2]


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def form_bodies(form: str, images: list[Image.Image]) -> tuple[list[bytes], str]:
    """``form``'s request bodies of ``images`` and their Content-Type."""
    if form == "png":
        return [_png(image) for image in images], "image/png"
    jpegs = tuple(jpeg(image, quality=QUALITIES[index % len(QUALITIES)]) for index, image in enumerate(images))
    if form == "json":
        return json_bodies(jpegs), "application/json"
    return request_bodies(jpegs, 4 if form == "multipart x4" else 1)


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, settings = text.partition(":")
    pairs = [pair.split("=", 1) for pair in settings.split(",") if pair]
    return name, {key.lower(): value for key, value in pairs}


def run(name: str, settings: dict[str, str], engine: str, seconds: float, clients: int, sample_s: float
        ) -> dict:
    """One variant's server under the load: its rate and each process's samples (its log folder removed after:
    a failed start's error says the log's end)."""
    with tempfile.TemporaryDirectory(prefix="visionserve-memory-") as logs:
        return _measured(Path(logs), name, settings, engine, seconds, clients, sample_s)


def _measured(logs: Path, name: str, settings: dict[str, str], engine: str, seconds: float, clients: int,
              sample_s: float) -> dict:
    weights = Path(__file__).resolve().parents[2] / "weights"
    server = visionserve(weights, logs, engine=engine, workers="2", **settings).wait_ready()
    samples: dict[int, list[float]] = {}
    kinds: dict[int, str] = {}
    done = threading.Event()

    def sample() -> None:
        started = time.monotonic()
        while not done.wait(sample_s):
            if time.monotonic() - started < WARM_UP_S:
                continue
            engines = set(engine_pids(process_tree_cpu(server.process.pid)))
            for pid in children(server.process.pid):
                if (read := cpu_and_memory(pid)) is not None:
                    kinds[pid] = "engine" if pid in engines else "worker"
                    samples.setdefault(pid, []).append(read[1] / 2**20)

    images = scaled_photos()
    answers: list[tuple[list[float], int, int]] = []

    def load(form: str) -> None:
        sent, content_type = form_bodies(form, images)
        answers.append(closed_loop(server.url + "/predict", sent, max(1, clients // len(FORMS)), seconds, 0.0,
                                   content_type=content_type))

    loads = [threading.Thread(target=load, args=(form,)) for form in FORMS]
    sampler = threading.Thread(target=sample, daemon=True)
    try:
        sampler.start()
        for thread in loads:
            thread.start()
        for thread in loads:
            thread.join()
    finally:
        done.set()
        sampler.join()
        server.stop()
    return {"name": name, "rate": sum(len(latencies) for latencies, _, _ in answers) / seconds,
            "errors": sum(errors for _, errors, _ in answers),
            "processes": [(kinds[pid], found[0], max(found), found[-1]) for pid, found in sorted(samples.items())]}


def report(found: list[dict], args: argparse.Namespace) -> str:
    lines = [f"{args.engine}, 2 workers, {args.clients} clients (a quarter each: {', '.join(FORMS)}), "
             f"{args.seconds:g} s a run, memory sampled every {args.sample_s:g} s after {WARM_UP_S:g} s; photos "
             f"{SIDES[0]}-{SIDES[-1]} px", "",
             "| variant | req/s | errors | process | MB first | MB most | MB last |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for point in found:
        for kind, first, most, last in point["processes"]:
            lines.append(f"| {point['name']} | {point['rate']:.1f} | {point['errors']} | {kind} | {first:.0f} | "
                         f"{most:.0f} | {last:.0f} |")
    for name in dict.fromkeys(point["name"] for point in found):
        lasts = [last for point in found if point["name"] == name for kind, _, _, last in point["processes"]
                 if kind == "worker"]
        rates = [point["rate"] for point in found if point["name"] == name]
        lines.append(f"\n{name}: workers' last {statistics.median(lasts):.0f} MB median ({min(lasts):.0f}-"
                     f"{max(lasts):.0f}), {statistics.median(rates):.1f} req/s median")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["inline", "process"], default="inline")
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--sample-s", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every variant, alternating them")
    parser.add_argument("--variant", action="append", help="NAME[:SETTING=VALUE,...] (repeat)")
    args = parser.parse_args(argv)
    if args.seconds <= WARM_UP_S + args.sample_s:  # (before: a run that short sampled nothing, then failed to report)
        parser.error(f"--seconds must be over {WARM_UP_S + args.sample_s:g}: memory is sampled every --sample-s "
                     f"after {WARM_UP_S:g} s of load")
    variants = [parse_variant(text) for text in (args.variant or DEFAULT_VARIANTS)]
    found = []
    for round_index in range(args.rounds):
        for name, settings in (variants if round_index % 2 == 0 else variants[::-1]):
            found.append(run(name, settings, args.engine, args.seconds, args.clients, args.sample_s))
            print(found[-1], flush=True)
    print(report(found, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
