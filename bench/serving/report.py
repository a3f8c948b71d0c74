"""The benchmark's report: a Markdown table per model, the raw JSON, and a chart (images/s and p99 against C)."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from bench.paths import RESULTS
from bench.serving.load import LoadResult


def fixed(value: float | None, digits: int) -> str:
    """``value`` with ``digits`` decimals, or "-" when it was not measured."""
    return f"{value:.{digits}f}" if value is not None else "-"


def row(r: LoadResult) -> str:
    """One load point as a table row."""
    return (f"| {r.server} | {r.concurrency} | {r.images_per_s:.1f} | {r.p50_ms:.0f} | {r.p95_ms:.0f} | "
            f"{r.p99_ms:.0f} | {r.errors} | {fixed(r.mean_batch, 2)} | {fixed(r.server_cores, 2)} | "
            f"{fixed(r.client_cores, 2)} | {fixed(r.cpu_ms_per_image, 1)} |")


def _limit(results: dict[str, Any]) -> dict[str, Any]:
    """The fastest measured pipeline without HTTP."""
    return max(results["limit"], key=lambda r: r["images_per_s"])


def _limit_at(results: dict[str, Any], concurrency: int) -> float:
    """One point's limit: the fastest pipeline, or the process pipeline measured right before the point if higher."""
    again = results.get("pipeline_at", {}).get(concurrency)
    return max(_limit(results)["images_per_s"], again["images_per_s"] if again else 0.0)


def _cpu_split(r: dict[str, Any], bound: dict[str, Any] | None) -> str:
    """Where the server's CPU per image went, next to what the CPU-time bound needs per image."""
    total, decode, forward = r.get("cpu_ms_per_image"), r.get("decode_cpu_ms"), r.get("forward_cpu_ms")
    if total is None or decode is None or forward is None:
        return ""
    text = (f"; server CPU per image {total:.1f} ms = decode {decode:.1f} + forward {forward:.1f} + HTTP, Python "
            f"and the rest {total - decode - forward:.1f}")
    if bound and bound.get("decode_ms") is not None:
        text += (f" (the bound counts decode {bound['decode_ms']:.1f} + forward {bound['single_ms']:.1f} = "
                 f"{bound['decode_ms'] + bound['single_ms']:.1f})")
    return text


def _model_section(model: str, results: dict[str, Any]) -> list[str]:
    best, ceiling = _limit(results), results["ceiling"]
    lines = [f"### {model}", "",
             f"Limit: **{best['images_per_s']:.1f} img/s**, the fastest measured pipeline without HTTP (decode + "
             f"preprocess + batched forward, over inference configurations, batch sizes, threads and processes): "
             f"here {best['config']} at batch {best['batch_size']}. Ceiling: {ceiling['images_per_s']:.1f} img/s, "
             f"the {ceiling['config']} at batch {ceiling['batch_size']}: it assumes both cores run as fast as "
             f"one alone, which no pipeline reaches; it is measured again right before each "
             f"visionserve point (this VM's speed drifts), as is the process pipeline, and each point is "
             f"compared with the ceiling of its minute and the higher of the two limits. In-process "
             f"single image, as served ({results['forward_threads']} forward thread(s), median over the "
             f"workload's photos): {results['single_image_ms']:.1f} ms.", "",
             "| limit configuration | batch | img/s |", "| --- | --- | --- |"]
    lines += [f"| {r['config']} | {r['batch_size']} | {r['images_per_s']:.1f} |" for r in results["limit"]]
    lines.append(f"| ceiling: {ceiling['config']} | {ceiling['batch_size']} | {ceiling['images_per_s']:.1f} |")
    lines += _request_path(results.get("request_path"), ceiling)
    lines += ["", "| server | C | img/s | p50 ms | p95 ms | p99 ms | errors | mean batch | server cores | "
              "client cores | server CPU ms/img |", "|" + " --- |" * 11]
    lines += [row(LoadResult(**r)) for r in results["loads"]]
    lines += _probes(results.get("probes", []))
    lines.append("")
    for name in dict.fromkeys(r["server"] for r in results["loads"] if _is_ours(r["server"])):
        lines += _against_peers(name, results)
    ours = {r["concurrency"]: r for r in results["loads"] if r["server"] == "visionserve"}
    if 1 in ours:
        lines.append(f"- C=1 p50 {ours[1]['p50_ms']:.1f} ms vs in-process single image "
                     f"{results['single_image_ms']:.1f} ms ({ours[1]['p50_ms'] / results['single_image_ms']:.2f}x)")
    return lines + [""]


def _request_path(path: dict[str, Any] | None, ceiling: dict[str, Any]) -> list[str]:
    """The service's request path in process, as an estimate of what any server running it pays per image, against
    the ceiling measured with it."""
    if not path:
        return []
    rest = path["cpu_ms_per_image"] - path["decode_ms"] - path["forward_ms"]
    return ["", f"Request path in process (bench/serving/request_path.py: the app called directly, one request at a "
            f"time, no HTTP, no other request): {path['cpu_ms_per_image']:.1f} ms CPU per image = decode "
            f"{path['decode_ms']:.1f} + forward {path['forward_ms']:.1f} + the rest {rest:.1f}, so with every core "
            f"busy about **{path['images_per_s']:.1f} img/s** at most, "
            f"{path['images_per_s'] / ceiling['images_per_s']:.2f} of the ceiling measured with it."]


def _is_ours(server: str) -> bool:
    return server.startswith("visionserve")


def _probes(probes: list[dict[str, Any]]) -> list[str]:
    """The candidate settings tried at C=16 before the run, the fastest first."""
    if not probes:
        return []
    lines = ["", "Settings tried at C=16 before the run (the fastest is measured above as the best):", "",
             "| settings | img/s | p99 ms |", "| --- | --- | --- |"]
    for probe in sorted(probes, key=lambda p: -p["images_per_s"]):
        settings = " ".join(f"{k.upper()}={v}" for k, v in probe["settings"].items()) or "defaults"
        lines.append(f"| {settings} | {probe['images_per_s']:.1f} | {probe['p99_ms']:.0f} |")
    return lines


def _against_peers(name: str, results: dict[str, Any]) -> list[str]:
    """One line per concurrency for one visionserve row: efficiency, ratios and p99 against the peers, CPU split."""
    lines = [f"{name}:"]
    for r in sorted((r for r in results["loads"] if r["server"] == name), key=lambda r: r["concurrency"]):
        c = r["concurrency"]
        peers = {p["server"]: p for p in results["loads"] if p["concurrency"] == c and not _is_ours(p["server"])}
        ratios = ", ".join(f"{r['images_per_s'] / p['images_per_s']:.2f}x {peer}" for peer, p in peers.items()
                           if p["images_per_s"])
        p99s = ", ".join(f"{p['p99_ms']:.0f} {peer}" for peer, p in peers.items())
        bound = results["bound_at"].get(c) or results["bound_at"].get(str(c))
        against_ceiling = f", {r['images_per_s'] / bound['images_per_s']:.2f} of the ceiling" if bound else ""
        lines.append(f"- C={c}: efficiency {r['images_per_s'] / _limit_at(results, c):.2f} of the limit"
                     + against_ceiling + (f"; {ratios}" if ratios else "")
                     + (f"; p99 {r['p99_ms']:.0f} ms against {p99s}" if p99s else "") + _cpu_split(r, bound))
    return lines


def chart(results: dict[str, Any], target: Path) -> None:
    """images/s and p99 latency against concurrency, one line per server, one row of plots per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(results), 2, figsize=(11, 4 * len(results)), squeeze=False,
                                constrained_layout=True)
    for (model, data), (rate_axes, p99_axes) in zip(results.items(), axes):
        servers = sorted({r["server"] for r in data["loads"]})
        for server in servers:
            points = sorted((r["concurrency"], r["images_per_s"], r["p99_ms"]) for r in data["loads"]
                            if r["server"] == server)
            rate_axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=server)
            p99_axes.plot([p[0] for p in points], [p[2] for p in points], marker="o", label=server)
        rate_axes.axhline(_limit(data)["images_per_s"], linestyle="--", color="grey", label="limit")
        rate_axes.axhline(data["ceiling"]["images_per_s"], linestyle=":", color="grey", label="ceiling")
        rate_axes.set(title=f"{model}: images/s", xlabel="concurrent clients", xscale="log")
        p99_axes.set(title=f"{model}: p99 latency (ms)", xlabel="concurrent clients", xscale="log", yscale="log")
        for ax in (rate_axes, p99_axes):
            ax.grid(alpha=0.3)
            ax.legend()
    figure.savefig(target, dpi=100)
    plt.close(figure)


def write(results: dict[str, Any], machine: dict[str, Any], args: argparse.Namespace, out_dir: Path) -> str:
    """Write <date>-<machine>.md, .json and .png into ``out_dir``; return the Markdown."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{time.strftime('%Y-%m-%d')}-{machine['device']}-{machine['cpus']}cpu-{platform.node() or 'host'}"
    lines = [f"# Benchmark {time.strftime('%Y-%m-%d %H:%M')}", "",
             f"Machine: {machine['platform']}, {machine['cpus']} CPU threads, torch {machine['torch']}, "
             f"device {machine['device']}. Whole run: {machine['seconds']} s. Closed loop, {args.seconds:g} s measured "
             f"after {args.warmup:g} s warm-up per point; the load generator runs on the same machine.", ""]
    for model, data in results.items():
        lines += _model_section(model, data)
    lines.append(f"![chart]({stem}.png)")
    markdown = "\n".join(lines) + "\n"
    (out_dir / f"{stem}.md").write_text(markdown)
    (out_dir / f"{stem}.json").write_text(json.dumps({"machine": machine, "results": results}, indent=1))
    chart(results, out_dir / f"{stem}.png")
    return markdown


def save_result(kind: str, text: str, machine: str | None = None) -> Path:
    """Write ``text`` to bench/results/<date>-<kind>-<machine>.md (default machine: cpu-<cores>cpu-vm), print it,
    and return the path."""
    out = RESULTS / f"{datetime.date.today()}-{kind}-{machine or f'cpu-{os.cpu_count()}cpu-vm'}.md"
    out.write_text(text, encoding="utf-8")
    print(text)
    return out
