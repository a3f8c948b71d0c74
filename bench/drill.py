"""The GPU drill: every figure and check a lent GPU machine is for, in one call that fits 8 minutes of wall time.

    python3 -m bench.drill --out $OUT                  # on the lent machine (docs/testing.md has the whole call)
    python -m bench.drill --smoke --out /tmp/drill     # the same steps, tiny, on this machine's CPU (the suite runs it)

Each step runs as its own process under its own time limit, inside the drill's deadline (a step that would start
with too little time left is skipped, and said so). After each step the drill appends one line to
``OUT/drill.jsonl`` (step, exit status, seconds, whether it was stopped) and rewrites ``OUT/figures.tar.gz`` from the
folder the steps write their reports into (``OUT/figures``), so a call stopped at any point returns what was done.
Every step's output goes to ``OUT/drill.log`` as it comes. A call starts clean: those, and the scratch folder beside
OUT (``OUT-work``: the photo folder), are emptied first. A step at its limit, or running when the drill gets SIGTERM
(then the rest are skipped), gets SIGTERM (a benchmark that started servers turns it into SystemExit and stops them,
harness/servers.py), and GRACE_S later SIGKILL, with every process that descended from it (servers and engines run
in sessions of their own). A step knows its deadline (BENCH_DEADLINE): a server that never gets ready fails inside
it, with its log. ``--only`` runs the steps named and those they need (``Step.needs``).

Steps, most wanted first: the machine's facts; the ``-m gpu`` tests (the device decode path's pixels, EXIF turns
included, placement, tensors, CUDA graphs against eager, the batch ceiling, the engine's loop running a graphed
version's batches, explanations in bfloat16); the served figures (``bench.serving.gpu``: the defaults in process mode
with one engine and with two (ENGINES_PER_DEVICE=2), and inline, on Lite0, 1 and 16 images per request, C=64 and 256,
and 4x overload at C=1024; each point printed as it comes), and its process-mode points again with 8 HTTP workers
(twice a 16-core host's default); one forward pass's GPU time and launches at a few batch sizes, eager and as a CUDA
graph, in float32 and bfloat16, contiguous and channels_last (``bench.serving.forward_launch``: the forward pass
bounds the device path at 6,496 images a second in float32); its served points again with the version's weights and
batches channels_last (MEMORY_FORMAT); then with the 8,000 aim's settings together (8 HTTP workers, two engines,
bfloat16 in channels_last); the engine alone on the device (``bench.serving.engine_only``: its CPU per request with no
HTTP worker beside it, its requests several to a message as HTTP workers' loops send them; its floor there, measured
on 11-29, by hand), beside it in the same rounds with its batches on the batcher's thread (ENGINE_LOOP_BATCH_MS=0, the
A/B of the loop's batches on CUDA); the device path's batch made step by step, with CUDA's spinning wait and with
blocking sync (``bench.serving.device_collate``); the engine's profile under load (``bench.serving.engine_profile``:
py-spy on it, the interpreter lock's holder and every thread on a CPU); the engine alone at 1, 4 and 16 images per
request with as many images in flight; the serving overhead (``bench.serving.overhead`` on the device: a one-layer
model and bodies that decode in microseconds, the HTTP workers' and the engine's CPU per request beside the bare Flask
app, the budget's unit, measured on this host); the device path's batch made the model's input, image by image and
rounded together (``bench.serving.batch_preprocess``); the served step's process-mode points again with a request
thread per request (LOOP_REQUESTS=false), with the tensor decode path (DECODE_PATH=tensor), with eager forward passes
(CUDA_GRAPHS=false: the graphs' A/B) and with every batch on the batcher's thread; ``models.predict`` on CUDA over a
photo folder (made first, with the served step's export where it made none); last, the training feed (JPEG folder on
the CPU and on the GPU against synthetic batches). The order follows what the last drills left to learn
(docs/testing.md): whether the code is right on the device, then the served figures and whether the HTTP workers bound
them and what the forward pass costs the GPU (the questions 12-04's drill left), then what earlier drills measured
already.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Sequence

from harness.processes import descendants, kill_left
from harness.servers import DEADLINE  # a step's deadline (time.time()), as its servers wait for

ROOT = Path(__file__).resolve().parents[1]
GRACE_S = 10.0  # between a step's SIGTERM and its SIGKILL: a benchmark stops its servers (5 s each at most)
POLL_S = 0.5  # how often a running step's descendants are collected
TERMINATED = threading.Event()  # the drill got SIGTERM: stop the step, pack what was done, end
GPU_TESTS = ("tests/unit/test_device.py", "tests/unit/test_tensor_decode.py", "tests/unit/test_load_placement.py",
             "tests/unit/test_cuda_graphs.py", "tests/app/test_batching_cap.py", "tests/app/test_explain.py",
             "tests/training/test_gpu_data.py")  # the files of the -m gpu tests


@dataclass(frozen=True)
class Step:
    name: str
    limit_s: float  # the most this step may take
    command: tuple[str, ...]
    least_s: float = 20.0  # not started with less time than this left
    env: tuple[tuple[str, str], ...] = ()  # settings of its own, beside the drill's environment
    needs: tuple[str, ...] = ()  # steps whose output it reads: run before it with --only


class _Served(NamedTuple):
    """A variant of the served step: its process-mode points again with other settings (a step of its own)."""

    name: str
    args: list[str]  # the served benchmark's engines, batch sizes, concurrency, images per request, seconds
    settings: tuple[tuple[str, str], ...] = ()  # environment variables of the servers it starts
    decode_path: str = "auto"
    workers: str = ""  # HTTP workers ("": the served step's)
    dtype: str = "float32"
    limit_s: float = 100


def steps(figures: Path, work: Path, smoke: bool) -> list[Step]:
    """The drill's steps, writing reports into ``figures`` and scratch into ``work``; ``smoke``: the same commands,
    tiny, on the CPU."""
    py = sys.executable
    photos = work / "photos"
    device, model = ("cpu", "mobilenet_v3_small") if smoke else ("cuda", "efficientnet_lite0")
    weights = ROOT / "bench" / ".work" / "weights" / model  # the served step's export, else the weights step's
    facts = ("import os, torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), "
             "torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU', 'cores', os.cpu_count())")
    if smoke:
        # process-2 runs the process mode's code as process does; inline: the served-tensor variant's (a server start
        # fewer: the suite's 15 minutes)
        engines = ["process-2"]
        served = ["--batch-sizes", "2", "--concurrency", "2",
                  "--images-per-request", "1", "2", "--seconds", "0.5", "--warmup", "0.2", "--limit-seconds", "0.3",
                  "--workers", "1"]
        overhead = ["--smoke", "--servers", "process", "--forms", "jpeg", "v2 x16"]  # inline: the served step
        engine = ["--forms", "v2 x1", "--concurrency", "2", "--seconds", "0.3"]
        by_size = ["--forms", "v2 x1", "v2 x2", "--images-in-flight", "2", "--seconds", "0.3"]
        variant = ["--engines", "inline", "--batch-sizes", "2", "--concurrency", "2", "--images-per-request", "1",
                   "--seconds", "0.5", "--warmup", "0.2"]  # inline: the cheapest to start
        more_workers_variant = aim_variant = variant
        auto_workers, more_workers = "1", "2"
        # the state dict: on the CPU the server's choice, ONNX Runtime, keeps its own layout
        launches = ["--model", model, "--dtypes", "float32", "--memory-formats", "contiguous", "channels_last",
                    "--weights-format", "state_dict", "--batch-sizes", "1", "2", "--seconds", "0.1"]
        preprocess = ["--batch-sizes", "1", "2", "--seconds", "0.05"]
        collate = ["--batch-sizes", "2", "--seconds", "0.02"]
        profile = ["--forms", "v2 x1", "--seconds", "1", "--rate", "200"]
        train = ["--archs", "resnet18", "--batch-size", "4", "--crop-size", "32", "--steps", "1", "--warmup", "1",
                 "--workers", "1", "--paths", "synthetic", "cpu"]
        photo_counts = ["--classes", "2", "--train-per-class", "4", "--val-per-class", "2"]
    else:
        engines = ["process", "process-2", "inline"]
        served = ["--batch-sizes", "64", "--concurrency", "64", "256", "1024",
                  "--images-per-request", "1", "16", "--seconds", "3", "--warmup", "1", "--limit-seconds", "2",
                  "--workers", "0"]
        overhead = ["--servers", "process", "inline", "--seconds", "2", "--concurrency", "16", "64", "--workers", "4",
                    "--forms", "jpeg", "v2 x1", "/v1/models"]  # 16 per request: the served step
        # two engine starts; its floor on a GPU host (51 us an image, 11-29: as on the CPU VM) is run by hand; on
        # four connections, as the served step's four HTTP workers' loop links (a turn's bundles span them: 12-02)
        engine = ["--forms", "v2 x1", "jpeg", "--concurrency", "16", "--seconds", "3", "--clients", "messages",
                  "--links", "4"]
        by_size = ["--forms", "v2 x1", "v2 x4", "v2 x16", "--images-in-flight", "64", "--seconds", "3"]
        variant = ["--engines", "process", "--batch-sizes", "64", "--concurrency", "64", "256", "--images-per-request",
                   "1", "16", "--seconds", "3", "--warmup", "1"]
        # more HTTP workers: one image a request (16 a request left their workers idle on 12-04: 0.9 of a core in
        # all), with one engine and with two (one engine's loop carried about what four workers sent it)
        more_workers_variant = ["--engines", "process", "process-2", "--batch-sizes", "64", "--concurrency", "64",
                                "256", "--images-per-request", "1", "--seconds", "3", "--warmup", "1"]
        auto_workers, more_workers = "0", "8"  # the served step's (4 on a 16-core host), and twice that
        # the 8,000 aim's settings together: more HTTP workers, two engines, a bfloat16 forward pass in channels_last
        aim_variant = ["--engines", "process-2", "--batch-sizes", "64", "--concurrency", "64", "256", "1024",
                       "--images-per-request", "1", "16", "--seconds", "3", "--warmup", "1"]
        # float32's 94 us an image at 64 bounds the device path at 6,496 img/s (12-04)
        launches = ["--model", model, "--dtypes", "float32", "bfloat16", "--memory-formats", "contiguous",
                    "channels_last", "--batch-sizes", "1", "8", "32", "64", "--seconds", "0.3"]
        preprocess = ["--batch-sizes", "1", "8", "64", "--seconds", "0.5"]
        collate = ["--batch-sizes", "1", "8", "32", "--seconds", "0.3"]
        profile = ["--forms", "v2 x1", "jpeg", "--seconds", "3"]
        train = ["--archs", "efficientnet_lite0", "--batch-size", "128", "--steps", "12", "--warmup", "4"]
        photo_counts = ["--classes", "20", "--train-per-class", "60", "--val-per-class", "20"]
    on_thread = (("VISIONSERVE_ENGINE_LOOP_BATCH_MS", "0"),)  # every batch on the batcher's thread
    channels_last = (("VISIONSERVE_MEMORY_FORMAT", "channels_last"),)
    variants = [_Served("served-more-workers", more_workers_variant, workers=more_workers, limit_s=140),
                _Served("served-threads", variant, (("VISIONSERVE_LOOP_REQUESTS", "false"),)),
                _Served("served-tensor", variant, decode_path="tensor"),
                _Served("served-eager", variant, (("VISIONSERVE_CUDA_GRAPHS", "false"),)),
                _Served("served-batcher-thread", variant, on_thread),
                _Served("served-channels-last", variant, channels_last),
                _Served("served-aim", aim_variant, channels_last, workers=more_workers, dtype="bfloat16", limit_s=140)]
    if smoke:  # one variant stands for both (the same command, another setting): the suite's 15 minutes
        variants = [variant for variant in variants if variant.name == "served-tensor"]
    if not smoke:  # the engine alone also with its batches on the batcher's thread, round by round: the A/B of the
        engine += ["--with-settings", "=".join(on_thread[0])]  # loop's batches on CUDA (two more engine starts)
    served_variants = [
        Step(v.name, v.limit_s, (py, "-m", "bench.serving.gpu", "--device", device, "--dtype", v.dtype, "--models",
                                 model, "--decode-paths", v.decode_path, "--workload", "imagenet", "--loads-only",
                                 *v.args, "--workers", v.workers or auto_workers, "--out", str(figures / v.name)),
             least_s=50, env=v.settings)
        for v in variants]
    # right after the served step: whether four HTTP workers' CPU bounds one image a request on the host (0.98-1.18
    # ms a request on an H200, 12-04, where one engine carried 4,890 img/s at C=256), which no drill has measured yet
    first_served = [step for step in served_variants if step.name == "served-more-workers"]
    # right after the forward pass's layouts: the served points with the version's weights and batches channels_last
    after_launches = [step for step in served_variants if step.name in ("served-channels-last", "served-aim")]
    return [
        Step("facts", 30, (py, "-c", facts), least_s=5),
        # first what says the code is right on the device: the loop's batches on CUDA among them (11-30)
        # the smoke collects the same files (its tests skip without CUDA): a file that cannot be collected fails here
        Step("gpu-tests", 130, (py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-m", "gpu",
                                *GPU_TESTS)),
        Step("served", 280, (py, "-m", "bench.serving.gpu", "--device", device, "--dtype", "float32", "--models",
                             model, "--engines", *engines, "--decode-paths", "auto", "--processes",
                             "--workload", "imagenet", *served, "--out", str(figures)), least_s=60),
        # the served step's process-mode points again with twice the HTTP workers
        *first_served,
        # one forward pass at a few batch sizes, eager and as a CUDA graph, in float32 and bfloat16, contiguous and
        # channels_last: its GPU time an image (what bounds the device path short of 8,000) and its launches
        Step("launches", 80, (py, "-m", "bench.serving.forward_launch", "--device", device, *launches, "--out",
                              str(figures)), least_s=25),
        *after_launches,
        # the engine's own cost per request on the device's host, its requests several to a message as the HTTP
        # workers' loop links send them, with and without its batches on its loop (four engine starts, about 30 s
        # each on an H200; each point printed to the log as it comes)
        Step("engine", 180, (py, "-m", "bench.serving.engine_only", "--device", device, *engine, "--out",
                             str(figures)), least_s=60),
        # the device path's batch made step by step (JPEGs to tensors, nvJPEG, preprocessing, a read-back), the batch
        # worker's CPU per image with CUDA's default spinning wait and with blocking sync, each in its own process
        Step("collate", 60, (py, "-m", "bench.serving.device_collate", "--device", device, *collate, "--out",
                             str(figures)), least_s=20),
        # where the engine's time goes under load: py-spy on it, the lock's holder and every thread on a CPU
        Step("profile", 80, (py, "-m", "bench.serving.engine_profile", "--device", device, *profile, "--out",
                             str(figures)), least_s=30),
        # the engine's CPU per image at 1, 4 and 16 images per request, as many images in flight, a frame each
        # (three engine starts)
        Step("engine-by-size", 80, (py, "-m", "bench.serving.engine_only", "--device", device, *by_size, "--out",
                                    str(figures / "by-size")), least_s=40),
        Step("overhead", 130, (py, "-m", "bench.serving.overhead", "--device", device, *overhead, "--out",
                               str(figures))),
        # the device path's batch made the model's input (resize, crop, normalise), image by image as before against
        # the crops rounded together: the thread's CPU and the steps per batch
        Step("preprocess", 40, (py, "-m", "bench.serving.batch_preprocess", "--device", device, *preprocess, "--out",
                                str(figures)), least_s=15),
        # the served step's process-mode points again with a request thread per request (LOOP_REQUESTS=false: the
        # HTTP workers as before 11-30), with the tensor decode path (DECODE_PATH=tensor: an engine's decode threads
        # on every core, where the device path decodes a batch on one thread), with eager forward passes
        # (CUDA_GRAPHS=false), then with every batch on the batcher's thread (ENGINE_LOOP_BATCH_MS=0: 0.80-0.86x the
        # loop's on 12-04, its points then cut short): each against the served step's, on one machine, back to back
        *(step for step in served_variants if step not in first_served + after_launches),
        Step("photos", 40, (py, "-m", "demo_data", "photos", "--out", str(photos), *photo_counts), least_s=10),
        # the served step's export, made here if it made none (the step skipped, stopped, or left out by --only)
        Step("weights", 60, (py, "-c", f"from bench.paths import WORK; from bench.serving.compare import "
                                       f"export_models; export_models(WORK / 'weights', ['{model}'])"), least_s=10),
        Step("predict", 50, (py, "-m", "models.predict", "--weights", str(weights), "--data", str(photos / "val"),
                             "--out", str(figures / "predict.jsonl"), "--device", device), needs=("photos", "weights")),
        Step("train-feed", 100, (py, "-m", "bench.training.train", "--device", device, "--data", str(photos),
                                 "--rounds", "1", "--no-variants", "--ddp", "0", *train, "--out", str(figures)),
             needs=("photos",)),
    ]


def _wait(process: subprocess.Popen, limit_s: float, found: dict[int, str]) -> int | None:
    """The step's exit status, or None at ``limit_s`` or once the drill got SIGTERM; its descendants collected into
    ``found`` meanwhile."""
    ends = time.monotonic() + limit_s
    while not TERMINATED.is_set():
        descendants(process.pid, found)
        try:
            return process.wait(max(0.0, min(POLL_S, ends - time.monotonic())))
        except subprocess.TimeoutExpired:
            if time.monotonic() >= ends:
                return None
    return None


def _run(step: Step, limit_s: float, log: Path) -> tuple[int | None, float, bool]:
    """Run one step in its own process group, its deadline in BENCH_DEADLINE (harness/servers.py: servers are waited
    for until then, less a margin); at ``limit_s`` (or on the drill's SIGTERM) SIGTERM the group (a benchmark turns
    it into SystemExit and stops its servers), then after GRACE_S SIGKILL the group and every process that
    descended from the step. (exit status, seconds, stopped)."""
    started = time.monotonic()
    found: dict[int, str] = {}
    with log.open("a") as out:
        out.write(f"\n===== {step.name} (limit {limit_s:.0f} s): {' '.join(step.command)}\n")
        out.flush()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **dict(step.env), DEADLINE: f"{time.time() + limit_s:.1f}"}
        process = subprocess.Popen(step.command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   process_group=0)  # the drill's session: what ends the drill's session ends it
        try:
            code = _wait(process, limit_s, found)
            if code is None:
                descendants(process.pid, found)
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(GRACE_S)
                except subprocess.TimeoutExpired:
                    descendants(process.pid, found)
            return code, time.monotonic() - started, code is None
        finally:
            try:  # what is left of its group, and every server it started and left behind
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
            kill_left(found)


def _pack(figures: Path, out: Path) -> None:
    """OUT/figures.tar.gz from the reports so far (written beside, then renamed: never half a file)."""
    partial = out / "figures.tar.gz.partial"
    with tarfile.open(partial, "w:gz") as tar:
        tar.add(figures, arcname="figures")
    partial.rename(out / "figures.tar.gz")


def _chosen(every: list[Step], only: Sequence[str]) -> list[Step]:
    """The steps named in ``only`` and what they need (``Step.needs``, and theirs), in the drill's order."""
    by_name = {step.name: step for step in every}
    wanted, todo = set(), list(only)
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted.add(name)
            todo += by_name[name].needs
    return [step for step in every if step.name in wanted]


def _on_sigterm(signum: int, frame: object) -> None:
    TERMINATED.set()  # the running step is stopped as at its limit, what was done packed, the rest skipped


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/.work/drill")))
    parser.add_argument("--deadline-s", type=float, default=450.0, help="the whole drill's wall time")
    parser.add_argument("--smoke", action="store_true", help="the same steps, tiny, on the CPU")
    parser.add_argument("--only", nargs="+", metavar="STEP",
                        help="these steps only (names as in drill.jsonl), and the steps they need (predict: photos "
                             "and weights; train-feed: photos)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    # the reports (packed into OUT/figures.tar.gz) under OUT; the scratch (the photo folder: too big to come back
    # with OUT) beside it; both emptied first, so a second call on one machine starts clean
    figures, work = args.out / "figures", args.out.parent / f"{args.out.name}-work"
    every = steps(figures, work, args.smoke)
    unknown = [name for name in args.only or () if name not in {step.name for step in every}]
    if unknown:
        parser.error(f"no step named {', '.join(unknown)}; the steps{' of --smoke' if args.smoke else ''}: "
                     f"{', '.join(step.name for step in every)}")
    for folder in (figures, work):
        shutil.rmtree(folder, ignore_errors=True)
    figures.mkdir(parents=True)
    log, record = args.out / "drill.log", args.out / "drill.jsonl"
    for path in (log, record):
        path.write_text("")
    _pack(figures, args.out)
    TERMINATED.clear()
    handled = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _on_sigterm) if handled else None
    try:
        return _steps(_chosen(every, args.only) if args.only else every, args, started, figures)
    finally:
        if handled:
            signal.signal(signal.SIGTERM, before)


def _steps(chosen: list[Step], args: argparse.Namespace, started: float, figures: Path) -> int:
    """Run ``chosen`` in order inside the deadline, a line each into drill.jsonl; 1 if any failed or was stopped."""
    log, record = args.out / "drill.log", args.out / "drill.jsonl"
    failed = 0
    for step in chosen:
        left = args.deadline_s - (time.monotonic() - started)
        if TERMINATED.is_set():
            row = {"step": step.name, "skipped": "the drill was stopped (SIGTERM)"}
        elif left < step.least_s:
            row = {"step": step.name, "skipped": f"{left:.0f} s left, needs {step.least_s:.0f}"}
        else:
            code, seconds, stopped = _run(step, min(step.limit_s, left), log)
            row = {"step": step.name, "rc": code, "seconds": round(seconds, 1), "stopped": stopped}
            if stopped and TERMINATED.is_set():
                row["stopped_by"] = "the drill's SIGTERM"
            failed += code != 0
            _pack(figures, args.out)
        with record.open("a") as out:
            out.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    return 1 if failed or TERMINATED.is_set() else 0


if __name__ == "__main__":
    raise SystemExit(main())
