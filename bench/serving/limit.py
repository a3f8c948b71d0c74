"""The limit: decode + preprocess + batched forward pass in one process, no HTTP, fastest configuration found.

    python -m bench.serving.limit --weights weights  # prints images/s per inference configuration and batch size

Images are decoded the way the server decodes them on the CPU (its default DECODE_PATH: the tensor path, libjpeg-turbo
into a tensor); in one process, decoding runs in a thread pool (the decoders release the GIL), overlapping the
forward pass of the previous batch. The same pipeline in one process per core with one forward thread each (as the service runs one gunicorn
worker per core on a CPU host) is measured too: on a small CPU it is the faster one.

The CPU-time bound (the ceiling) adds up decode and forward times measured alone on one core, with warm caches:
no pipeline reaches it, since decoding the next image evicts the weights the forward pass wants (measured for
mobilenet_v3_small: one image's forward took 4.5 ms warm, 5.4 ms right after a decode).
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import queue
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

import torch

from app.config import Settings
from app.engine.decoding.image import DecodeLimits, image_to_tensor
from app.engine.loaded.predictor import Predictor
from app.engine.decoding.tensor import image_to_tensor_path
from app.engine.decoding.decoders import decode_path
from models.architectures import split_outputs
from models.data.malloc import keep_freed_memory
from models.export.load import optimize_for_cpu

Forward = Callable[[torch.Tensor], torch.Tensor]
T = TypeVar("T")
# The service's default limits (and any VISIONSERVE_* overrides), so every contender decodes the same way.
_SERVED = Settings()
LIMITS = DecodeLimits.from_settings(_SERVED)
DECODE_PATH = decode_path(_SERVED.decode_path, torch.device("cpu"))  # what the server decodes with on the CPU
# The server's glibc tuning for decode buffers (its workers apply it at start; without it large decodes page-fault
# fresh memory each time): in this process and in each spawned pipeline process, which imports this module.
keep_freed_memory(_SERVED.malloc_trim_threshold_mb, _SERVED.malloc_arena_max)


def decode_served(data: bytes, predictor: Predictor) -> torch.Tensor:
    """One image decoded and preprocessed the way the server does on the CPU (its default decode path)."""
    if DECODE_PATH == "tensor":
        return image_to_tensor_path(data, predictor.tensor_transform, LIMITS)
    return image_to_tensor(data, predictor.transform, LIMITS)


@dataclass(frozen=True)
class LimitResult:
    """Images/s of one configuration at one batch size, and its single-image latency."""

    config: str
    batch_size: int
    images_per_s: float
    single_ms: float | None  # one image's forward pass; for the CPU-time bound, its forward ms per image
    decode_ms: float | None = None  # the CPU-time bound's decode + preprocess ms per image
    forward_config: str | None = None  # the CPU-time bound's fastest forward configuration (a configurations() key)
    threads: str | None = None  # the intra-op and decode threads of the fastest end-to-end run


def configurations(weights: Path, compile_too: bool) -> tuple[Predictor, dict[str, Forward]]:
    """Candidate inference configurations of the same weights, each a callable on an NCHW float batch."""
    base = Predictor.load(weights, weights_format="torchscript", device="cpu")
    optimized = optimize_for_cpu(base.module, base.manifest)

    def channels_last(forward: Forward) -> Forward:
        return lambda x: forward(x.contiguous(memory_format=torch.channels_last))

    configs: dict[str, Forward] = {
        "torchscript": base.module, "torchscript, channels_last input": channels_last(base.module),
        "frozen+optimize_for_inference (served)": optimized,
        "frozen+optimize_for_inference, channels_last input": channels_last(optimized)}
    if base.manifest.onnx is not None:  # what the server runs on the CPU, with the thread count a worker gives it
        from app.engine.batching.tuning import forward_threads
        from app.hosting.host import workers_for
        from models.export.load import OnnxModel
        from models.export.onnx_runtime import session

        served_threads = forward_threads(0, torch.device("cpu"), workers=workers_for(0, "cpu")[0])
        runner = session(weights / base.manifest.onnx.path, served_threads)
        configs[ONNX_SERVED] = OnnxModel(runner, base.manifest.onnx)
    if compile_too:
        eager = Predictor.load(weights, weights_format="state_dict", device="cpu").module
        configs["torch.compile(freezing), channels_last"] = channels_last(torch.compile(
            eager.to(memory_format=torch.channels_last), dynamic=False, options={"freezing": True}))
    return base, configs


@contextlib.contextmanager
def intra_op_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` inside the block, and back to what they were after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def timed_rate(work: Callable[[], int], seconds: float) -> float:
    """Items/s of ``work`` (which returns how many items it did) run again and again for ``seconds``; its first
    call (compilation, cuDNN autotuning, nvjpeg set-up) is not timed."""
    work()
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        done += work()
    return done / (time.perf_counter() - started)


def _forward_rate(forward: Forward, batch: torch.Tensor, seconds: float) -> float:
    def run() -> int:
        forward(batch)
        return len(batch)

    with torch.inference_mode():
        return timed_rate(run, seconds)


def end_to_end_rate(forward: Forward, predictor: Predictor, photos: Sequence[bytes], batch_size: int,
                    seconds: float, threads: int = 2, ready: Callable[[], object] = lambda: None) -> float:
    """Decode (parallel threads) + preprocess + forward, batch after batch, for ``seconds``; ``ready`` is called
    after the untimed first forward pass."""
    def decode(i: int) -> torch.Tensor:
        return decode_served(photos[i % len(photos)], predictor)

    with ThreadPoolExecutor(threads) as pool, torch.inference_mode():
        forward(torch.stack([decode(0)] * batch_size))  # first call per shape (compilation) is not timed
        ready()
        done, index, started = 0, 0, time.perf_counter()
        pending = pool.map(decode, range(index, index + batch_size))
        while time.perf_counter() - started < seconds:
            batch = torch.stack(list(pending))
            index += batch_size
            pending = pool.map(decode, range(index, index + batch_size))  # decode the next batch meanwhile
            split_outputs(forward(batch))[0].softmax(dim=1)
            done += batch_size
    return done / (time.perf_counter() - started)


def measure(predictor: Predictor, configs: dict[str, Forward], photos: Sequence[bytes],
            batch_sizes: Sequence[int], seconds: float) -> list[LimitResult]:
    """Every configuration at every batch size, end to end; the best is the limit."""
    shape = predictor.manifest.preprocess.input_shape
    results = []
    cores = torch.get_num_threads()
    for name, forward in configs.items():
        single = 1000 / _forward_rate(forward, torch.randn(1, *shape), seconds / 2)
        for size in batch_sizes:
            rate, threads = best_threads(forward, predictor, photos, size, seconds, cores)
            results.append(LimitResult(name, size, rate, single, threads=threads))
    return results


def best_threads(forward: Forward, predictor: Predictor, photos: Sequence[bytes], batch_size: int, seconds: float,
                 cores: int) -> tuple[float, str]:
    """The fastest end-to-end images/s over 1 or ``cores`` intra-op threads and ``cores`` or twice as many
    decode threads (decoding competes with the forward pass for the cores), and which combination it was."""
    rates = []
    for torch_threads in sorted({1, cores}):
        with intra_op_threads(torch_threads):
            rates += [(end_to_end_rate(forward, predictor, photos, batch_size, seconds, decode_threads),
                       f"{torch_threads} intra-op, {decode_threads} decode threads")
                      for decode_threads in (cores, 2 * cores)]
    return max(rates)


BOUND_BATCH_SIZES = (1, 2, 4, 8)


def cpu_time_bound(predictor: Predictor, configs: dict[str, Forward], photos: Sequence[bytes]) -> LimitResult:
    """An upper bound from CPU time: cores / (decode + preprocess + forward seconds per image, each on one core),
    with the fastest configuration and batch size for the forward pass.

    No pipeline can beat it on this machine (it assumes perfect overlap and no HTTP, queueing or Python overhead),
    so efficiency against it is honest even where the in-process harness above is the slower one. It takes a few
    seconds, so the benchmark measures it again right before each of visionserve's points: this VM's speed
    drifts by up to 1.5x over minutes, and a bound from another minute would make the ratio noise.
    """
    cores = torch.get_num_threads()
    shape = predictor.manifest.preprocess.input_shape
    with intra_op_threads(1), torch.inference_mode():
        decode_s = statistics.mean(min(_timed(lambda p=p: decode_served(p, predictor))
                                       for _ in range(2)) for p in photos)
        forward_s, name, batch_size = min(
            (_forward_s_per_image(forward, torch.randn(size, *shape)), name, size)
            for name, forward in configs.items() for size in BOUND_BATCH_SIZES)
    return LimitResult(f"CPU-time bound ({cores} cores, decode {decode_s * 1000:.1f} ms + forward "
                       f"{forward_s * 1000:.1f} ms per image, {name})", batch_size, cores / (decode_s + forward_s),
                       forward_s * 1000, decode_s * 1000, name)


SERVED = "frozen+optimize_for_inference (served)"  # WEIGHTS_FORMAT=torchscript, and auto without an ONNX file
ONNX_SERVED = "ONNX Runtime (served)"  # auto on the CPU: the export's ONNX file, the server's thread count


def served_config(configs: dict[str, Forward]) -> str:
    """The configuration the server runs by default on the CPU for these weights."""
    return ONNX_SERVED if ONNX_SERVED in configs else SERVED


def _pipeline_process(weights: Path, config: str, batch_size: int, decode_threads: int, photos: Sequence[bytes],
                      seconds: float, start: "multiprocessing.synchronize.Barrier",
                      rates: "multiprocessing.Queue[float]") -> None:
    """One worker's pipeline without HTTP: one forward thread, decode threads overlapping it; reports images/s."""
    torch.set_num_threads(1)
    if "/" in config:  # "cuda/float16": the served model, placed as the service places it, in that dtype
        device, dtype = config.split("/")
        predictor = Predictor.load(weights, device=device, dtype=dtype)
        forward: Forward = predictor.predict_batch
    else:
        predictor, configs = configurations(weights, compile_too=False)
        forward = configs[config]
    # ``start``: every process measures over the same seconds
    rates.put(end_to_end_rate(forward, predictor, photos, batch_size, seconds, decode_threads, start.wait))


def next_report(reports: "multiprocessing.Queue[T]", workers: Sequence[multiprocessing.process.BaseProcess],
                timeout_s: float = 300) -> T:
    """The next thing a spawned process reported; raises as soon as one of ``workers`` has died (a crash, the
    kernel's OOM killer) instead of waiting out the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return reports.get(timeout=1)
        except queue.Empty:
            dead = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a spawned process exited with code {dead[0]}") from None
    raise TimeoutError(f"no spawned process reported within {timeout_s:g}s")


def process_pipeline(weights: Path, photos: Sequence[bytes], config: str, batch_size: int, seconds: float,
                     processes: int, decode_threads: int = 1) -> LimitResult:
    """``processes`` copies of the pipeline at once, one forward thread each: their summed images/s.

    Unlike the CPU-time bound, the cores really share the caches and memory bandwidth while it runs. A
    torch.compile configuration is replaced by the served one (compiling in every process would take minutes).
    """
    if "compile" in config:
        config = SERVED
    context = multiprocessing.get_context("spawn")  # never fork a process that has run torch
    start, rates = context.Barrier(processes), context.Queue()
    workers = [context.Process(target=_pipeline_process, args=(weights, config, batch_size, decode_threads,
                                                               list(photos), seconds, start, rates))
               for _ in range(processes)]
    for worker in workers:
        worker.start()
    try:
        total = sum(next_report(rates, workers) for _ in workers)
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
    return LimitResult(f"{processes} processes x (1 forward thread + {decode_threads} decode), {config}", batch_size,
                       total, None)


def _forward_s_per_image(forward: Forward, batch: torch.Tensor) -> float:
    forward(batch)
    return min(_timed(lambda: forward(batch)) for _ in range(3)) / len(batch)


def _timed(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def single_image_ms(predictor: Predictor, photos: Sequence[bytes], threads: int, rounds: int = 2) -> float:
    """Median in-process latency of one image over the same photos the load uses: decode + preprocess + forward,
    with the intra-op threads the service gives its forward pass."""
    times = []
    with intra_op_threads(threads), torch.inference_mode():
        for photo in list(photos) * rounds:
            started = time.perf_counter()
            predictor.predict_batch(decode_served(photo, predictor).unsqueeze(0))
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def main() -> None:
    """Print images/s for each configuration and batch size."""
    from harness.photos import workload

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", type=Path, default=Path("weights"))
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--compile", action="store_true", help="also try torch.compile (slow to compile)")
    args = parser.parse_args()
    predictor, configs = configurations(args.weights, args.compile)
    for r in measure(predictor, configs, workload(), (1, 4, 8, 16), args.seconds):
        print(f"{r.config:52s} batch {r.batch_size:2d}: {r.images_per_s:6.1f} img/s  "
              f"(1 image forward {r.single_ms:.1f} ms)")


if __name__ == "__main__":
    main()
