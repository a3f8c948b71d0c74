"""The report of ``python -m bench.training.train``: a table per section in markdown, the figures as JSON, and a
chart."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

PATH_NAMES = {"synthetic": "synthetic (limit)", "cpu": "JPEG folder, CPU path", "gpu": "JPEG folder, GPU path"}


def _num(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _rows(points: Sequence[Any], largest: dict[str, int | None]) -> list[str]:
    rows = ["| arch | data | img/s | of the limit | waiting for data | GPU util | host cores | peak GPU memory "
            "| largest batch |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        rows.append(f"| {p.arch} | {PATH_NAMES.get(p.path, p.path)} | {p.images_per_s:.1f} "
                    f"| {_num(p.of_limit, '.2f')} | {_num(p.data_wait and p.data_wait * 100, '.0f', '%')} "
                    f"| {_num(p.gpu_util, '.0f', '%')} | {_num(p.host_cores, '.1f')} "
                    f"| {_num(p.peak_gpu_memory_mb and p.peak_gpu_memory_mb / 1024, '.1f', ' GiB')} "
                    f"| {_num(largest.get(p.arch) if p.path == 'synthetic' else None, 'd')} |")
    return rows


def _variant_rows(variants: Sequence[Any]) -> list[str]:
    if not variants:
        return []
    base = variants[0].images_per_s
    rows = ["", f"### The training step's choices ({variants[0].arch}, synthetic data, batch {variants[0].batch_size})",
            "", "| step | img/s | vs as shipped |", "|---|---:|---:|"]
    rows += [f"| {v.note} | {v.images_per_s:.1f} | {v.images_per_s / base:.2f}x |" for v in variants]
    return rows


def write_report(out: Path, stem: str, meta: dict[str, Any], points: Sequence[Any], variants: Sequence[Any],
                 largest: dict[str, int | None], checkpoint: dict[str, float] | None,
                 ddp: dict[str, float]) -> Path:
    """Write ``stem``.md, .json and .png under ``out``; returns the markdown's path."""
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# Training speed: {meta['device_name']}", "", f"`{meta['command']}`", "",
             *(f"- {key}: {value}" for key, value in meta.items() if key not in ("command", "device_name")), "",
             *_rows(points, largest), *_variant_rows(variants)]
    if checkpoint:
        lines += ["", f"Checkpoint of {checkpoint['bytes'] / 2**20:.0f} MiB: the loop waits "
                      f"{checkpoint['writer_s']:.3f} s with the writer thread, {checkpoint['inline_s']:.3f} s written "
                      "inline."]
    if ddp:
        lines += ["", "### DDP scaling (synthetic)", "", "| arch | processes | img/s | scaling efficiency |",
                  "|---|---:|---:|---:|"]
        lines += [f"| {key.split('@')[0]} | {key.split('@')[1]} | {value['images_per_s']:.1f} "
                  f"| {value['efficiency']:.2f} |" for key, value in ddp.items()]
    md = out / f"{stem}.md"
    md.write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / f"{stem}.json").write_text(json.dumps({
        "meta": meta, "points": [asdict(p) for p in points], "variants": [asdict(v) for v in variants],
        "largest_batch": largest, "checkpoint": checkpoint, "ddp": ddp}, indent=2) + "\n", encoding="utf-8")
    _chart(out / f"{stem}.png", meta["device_name"], points)
    return md


def _chart(path: Path, title: str, points: Sequence[Any]) -> None:
    """Grouped bars: per arch, images/s of each data path, labelled with the share of the limit."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    archs = list(dict.fromkeys(p.arch for p in points))
    paths = [name for name in PATH_NAMES if any(p.path == name for p in points)]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(len(paths), 1)
    for k, name in enumerate(paths):
        for i, arch in enumerate(archs):
            point = next((p for p in points if p.arch == arch and p.path == name), None)
            if point is None:
                continue
            x = i + (k - (len(paths) - 1) / 2) * width
            ax.bar(x, point.images_per_s, width, color=f"C{k}", label=PATH_NAMES[name] if i == 0 else None)
            if point.of_limit is not None and name != "synthetic":
                ax.text(x, point.images_per_s, f"{point.of_limit:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(archs)), archs)
    ax.set_ylabel("training images/s")
    ax.set_title(f"Training throughput, {title} (labels: share of the synthetic limit)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
