"""The device decode path's batch, step by step, at the batch worker's cost (issue #50): on a GPU host the engine's
time per image beyond its forward pass was 553 us for the overhead benchmark's JPEGs against 210 for V2 tensors
(engine alone, 2026-11-29, H200), so the batch's making (``collate_on_device``: the JPEGs to tensors, one batched
nvJPEG call, the resize, crop and normalisation) is where a JPEG's engine time goes. This times each step as the
batch worker runs it.

    python3 -m bench.serving.device_collate --device cuda --out FOLDER   # on a GPU host (the drill runs it)
    .venv/bin/python -m bench.serving.device_collate --device cpu         # the same steps on the CPU (libjpeg-turbo)

Two workloads: the overhead benchmark's bodies (8x8 photos padded to 100 KB: what the engine's budget is measured
with) through the tiny model's preset, and the ImageNet-size photos through Lite0's. For each batch size and step:
the thread's CPU per image in the call (``time.thread_time``: what the interpreter lock may be held for), its CPU
per image with the wait for the device included (a CUDA wait spins the calling thread unless the context was made
with blocking sync), and the wall time per image, waited for. Steps: ``bytes`` (each body made a tensor),
``decode`` (``decode_jpegs``: on CUDA one batched nvJPEG call, then the EXIF turns), ``preprocess``
(``TensorEvalTransform.batch``), ``collate`` (the whole of ``collate_on_device``, as the engine calls it), and
``readback`` (a batch of 1,000-class rows computed on the device and brought back, as a forward pass's answer is).

``--sync both`` (the default on CUDA) runs every step twice, each in a process of its own: with CUDA's default
scheduling (``spin``: a thread waiting for the device spins while it has a core) and with the primary context set to
blocking sync before torch makes it (``blocking``: the waiting thread sleeps until the device signals). Writes
``device-collate-<device>.json`` and ``.md`` into ``--out``.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch

from app.engine.decoding.device import Encoded, check_header, collate_on_device
from app.engine.decoding.image import DecodeLimits
from bench.serving.forward_launch import WORK, device_name, timed_waits, write_report
from bench.serving.tiny_work import padded_jpeg
from harness.photos import imagenet_workload
from models.data.jpeg import decode_jpegs
from models.presets import EvalPreset, TensorEvalTransform, lite0_preset

CU_CTX_SCHED_BLOCKING_SYNC = 0x04  # cuda.h: a thread waiting for the device sleeps on a signal instead of spinning
STEPS = ("bytes", "decode", "preprocess", "collate", "readback")


def _driver_device(ordinal: int) -> tuple[ctypes.CDLL, ctypes.c_int] | str:
    """The CUDA driver and its handle of device ``ordinal``, or why not, in words."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"no driver: {exc}"
    device = ctypes.c_int()
    for step, code in (("cuInit", lambda: driver.cuInit(0)),
                       ("cuDeviceGet", lambda: driver.cuDeviceGet(ctypes.byref(device), ordinal))):
        if (status := code()) != 0:
            return f"{step} returned {status}"
    return driver, device


def schedule_blocking_sync(ordinal: int = 0) -> str:
    """Set the device's primary context to blocking sync through the driver, before torch makes the context (call
    it before anything asks torch about the device). Returns what happened, in words."""
    found = _driver_device(ordinal)
    if isinstance(found, str):
        return found
    driver, device = found
    status = driver.cuDevicePrimaryCtxSetFlags_v2(device, CU_CTX_SCHED_BLOCKING_SYNC)
    return "asked" if status == 0 else f"cuDevicePrimaryCtxSetFlags returned {status}"


def primary_context_flags(ordinal: int = 0) -> str:
    """The device's primary context as the driver holds it now: its flags and whether it is active, in words (what
    a run with blocking sync really ran with)."""
    found = _driver_device(ordinal)
    if isinstance(found, str):
        return found
    driver, device = found
    flags, active = ctypes.c_uint(), ctypes.c_int()
    status = driver.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active))
    if status != 0:
        return f"cuDevicePrimaryCtxGetState returned {status}"
    schedule = "blocking sync" if flags.value & 0x07 == CU_CTX_SCHED_BLOCKING_SYNC else f"flags {flags.value:#x}"
    return f"{schedule}, {'active' if active.value else 'inactive'}"


def workloads() -> dict[str, tuple[list[bytes], EvalPreset]]:
    """The bodies and the preset they are served with, by workload name."""
    return {"padded 8x8 (tiny model)": ([padded_jpeg(seed) for seed in range(8)], EvalPreset(resize_size=8,
                                                                                           crop_size=8)),
            "ImageNet-size photos (Lite0)": (list(imagenet_workload()), lite0_preset())}


def measure(device: torch.device, batch_sizes: Sequence[int], seconds: float, sync_mode: str) -> list[dict]:
    """One row per workload, batch size and step (see the module's docstring)."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows: list[dict] = []
    for workload, (bodies, preset) in workloads().items():
        transform = TensorEvalTransform(preset)
        for size in batch_sizes:
            chosen = [bodies[i % len(bodies)] for i in range(size)]
            items: list[Encoded] = [check_header(body, DecodeLimits()) for body in chosen]
            encoded = [torch.frombuffer(bytearray(item.data), dtype=torch.uint8) for item in items]
            decoded = decode_jpegs(encoded, device, [item.orientation for item in items])
            logits = torch.randn(size, 1000, device=device)
            calls: dict[str, Callable[[], object]] = {
                "bytes": lambda: [torch.frombuffer(bytearray(item.data), dtype=torch.uint8) for item in items],
                "decode": lambda: decode_jpegs(encoded, device, [item.orientation for item in items]),
                "preprocess": lambda: transform.batch(decoded),  # type: ignore[arg-type]
                "collate": lambda: collate_on_device(items, device, transform, torch.float32),
                "readback": lambda: logits.softmax(dim=1).cpu(),
            }
            for step in STEPS:
                in_call, with_wait, wall, _ = timed_waits(calls[step], sync, seconds)
                rows.append({"sync": sync_mode, "workload": workload, "batch": size, "step": step,
                             "cpu_us_per_image": in_call / size, "cpu_with_wait_us_per_image": with_wait / size,
                             "wall_us_per_image": wall / size})
    return rows


def report(rows: Sequence[dict], machine: dict[str, object]) -> str:
    """The rows as one markdown table per workload: a column group per synchronisation mode."""
    modes = list(dict.fromkeys(r["sync"] for r in rows))
    lines = [f"# The device path's batch, step by step: {machine['device_name']}, torch {machine['torch']}", "",
             "The batch worker's thread per image: CPU in the call / CPU with the wait for the device / wall, in us. "
             f"Synchronisation: {', '.join(f'{m} ({machine.get(m, m)})' for m in modes)}.", ""]
    for workload in dict.fromkeys(r["workload"] for r in rows):
        lines += [f"## {workload}", "", "| batch | step | " + " | ".join(f"{m}: CPU | with wait | wall" for m in modes)
                  + " |", "| --- | --- |" + " --- | --- | --- |" * len(modes)]
        keyed = {(r["sync"], r["batch"], r["step"]): r for r in rows if r["workload"] == workload}
        for batch in dict.fromkeys(r["batch"] for r in rows):
            for step in STEPS:
                cells = []
                for mode in modes:
                    r = keyed.get((mode, batch, step))
                    cells += (["-"] * 3 if r is None else
                              [f"{r[key]:.0f}" for key in ("cpu_us_per_image", "cpu_with_wait_us_per_image",
                                                            "wall_us_per_image")])
                lines.append(f"| {batch} | {step} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--seconds", type=float, default=0.5, help="per step and point")
    parser.add_argument("--sync", choices=("both", "spin", "blocking"), default="both",
                        help="CUDA's scheduling of a waiting thread; both: each in a process of its own")
    parser.add_argument("--rows-to", type=Path, help=argparse.SUPPRESS)  # one mode's rows, for --sync both
    parser.add_argument("--out", type=Path, default=WORK / "device-collate")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    blocking = args.sync == "blocking" and device.type == "cuda"
    asked = schedule_blocking_sync(device.index or 0) if blocking else ""  # before torch makes the context
    machine: dict[str, object] = {"device_name": device_name(device), "torch": torch.__version__}
    if args.sync == "both" and device.type == "cuda":
        rows: list[dict] = []
        for mode in ("spin", "blocking"):
            rows_file = args.out / f".device-collate-{mode}.json"
            args.out.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, "-m", "bench.serving.device_collate", "--device", args.device,
                            "--batch-sizes", *map(str, args.batch_sizes), "--seconds", str(args.seconds),
                            "--sync", mode, "--rows-to", str(rows_file)], check=True)
            found = json.loads(rows_file.read_text())
            rows += found["rows"]
            machine[mode] = found["how"]
            rows_file.unlink()
    else:
        mode = "spin" if args.sync == "both" else args.sync
        how = "CUDA's default" if mode == "spin" else "none on the CPU"
        rows = measure(device, args.batch_sizes, args.seconds, mode)
        if device.type == "cuda":  # read back after the run: what its context really had
            ran = primary_context_flags(device.index or 0)
            how = f"blocking sync {asked}; ran with: {ran}" if blocking else f"CUDA's default; ran with: {ran}"
        if args.rows_to:
            args.rows_to.write_text(json.dumps({"how": how, "rows": rows}))
            return
        machine[mode] = how
    write_report(args.out / f"device-collate-{device.type}", machine, rows, report(rows, machine))


if __name__ == "__main__":
    main()
