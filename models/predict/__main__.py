"""Score a folder, a file list or one image with the served artefact, or evaluate it on a labelled folder, in process.

    .venv/bin/python -m models.predict --weights weights --data photos/ --out scores.jsonl        # or .csv, .parquet
    .venv/bin/python -m models.predict --weights repository --model mine --version 2 --data list.txt --out scores.csv
    .venv/bin/python -m models.predict --weights runs/mine/export --data data/mine/val --labels data/mine/val \\
        --out eval.jsonl
    .venv/bin/python -m models.predict --weights weights --data photos/ --out scores.jsonl --embeddings photos.npy
    torchrun --nproc_per_node=N -m models.predict ...          # one process per GPU (or CPU processes, gloo)

The model is loaded as the server loads it (models/export/load.py: the format the server would choose, on the CPU
the ONNX file under ONNX Runtime when the export has one, else TorchScript frozen; its checks, device, dtype) and
each image preprocessed as the server's decode path does (``--decode``). One line per input, in input order; a file
that cannot be scored gets its reason. A rerun skips what is written: Ctrl-C prints how much is written and the
command that goes on.

``--embeddings photos.npy`` also writes each scored image's embedding, from the same forward pass: photos.npy holds
them (float32, one row per image, N x dim, L2-normalised: a dot product is a cosine similarity) in the records'
order, photos.names.txt beside it their paths, one a line, and photos.meta.json the model, version and --out
they are of (a rerun keeps the rows only when they match it). A file that cannot be scored has no row (and no
name). ``python -m models.neighbours photos.npy --duplicates`` finds the near-duplicates among them.
"""
from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from tqdm import tqdm

from models.architectures import split_outputs
from models.data.malloc import DEFAULT_TRIM_THRESHOLD_MB, keep_freed_memory
from models.export.checks import ModelLoadError, read_checked_manifest, resolve_device
from models.export.load import LoadedModel, load_model
from models.export.manifest import Manifest
from models.export.repository import RepositoryError, is_export, models, named_default, newest
from models.predict.decode import PATHS, ScoreSet, collate, on_device
from models.predict.evaluate import (check_labels, evaluation, mistakes, report_folder, trained_count,
                                     trained_warning, write_report)
from models.predict.inputs import Item, Labels, check_outside, chunks_for_rank, list_inputs
from models.predict.outputs import (
    EMBEDDINGS_SUFFIX,
    PartWriter,
    Record,
    check_parquet_names,
    check_same_model,
    check_same_options,
    check_same_top_k,
    done_paths,
    hold_output,
    merged_records,
    merged_refusal,
    names_file,
    output_format,
    part_file,
    parts_dir,
    read_records,
    repair_tail,
    stored_embeddings,
    write_embeddings,
    write_merged,
)
from models.presets import TensorEvalTransform
from models.run.args import DataError
from models.run.distributed import (DistEnv, barrier, destroy_process_group, env_from_torchrun, exit_status,
                                    init_process_group, terminated_as_interrupt)
from models.commands import python_command
from models.run.report import rerun_command
from models.serving import forward_threads, usable_cores

log = logging.getLogger("models.predict")
DEFAULT_TOP_K = 5  # answers per image without --top-k (fewer for a model of fewer classes)
CPU_BATCH = 16  # the CPU's default (the limit's best batch here was 8); on CUDA: as large as fits (largest_batch)
CUDA_BATCH_CAP = 512
NON_FINITE = "the model produced non-finite output (NaN or infinity) for this image"  # its error record


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``minimum``, so a value out of range stops the command at once
    (exit 2, with the usage) rather than after the model loaded, or in a run that scores nothing and exits 0."""
    def whole(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return whole


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"{python_command()} -m models.predict", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", type=Path, required=True, help="an export (with manifest.json) or a repository")
    parser.add_argument("--model",
                        help="the repository's model (default: its only one, or the one its repository.json names)")
    parser.add_argument("--version", help="the model's version (default: the newest)")
    parser.add_argument("--data", type=Path, required=True,
                        help="a folder (every file under it), a file list or one image")
    parser.add_argument("--out", type=Path, required=True, help="FILE.jsonl, .csv or .parquet")
    parser.add_argument("--labels", type=Path, help="evaluate: a DIR/<class>/ folder or a CSV of path,label")
    parser.add_argument("--report", type=Path,
                        help="the evaluation's folder (default: beside OUT, its name without the extension + "
                             "-report: eval.jsonl's is eval-report/)")
    parser.add_argument("--top-k", type=at_least(1), default=None,
                        help=f"answers per image, at most the model's classes (default {DEFAULT_TOP_K}, or its classes "
                             "if fewer)")
    parser.add_argument("--mistakes", type=at_least(0), default=60, help="mistakes shown in mistakes.html (default 60)")
    parser.add_argument("--batch-size", type=at_least(0), default=0,
                        help=f"images per forward pass; 0: {CPU_BATCH} on the CPU, the largest that fits on CUDA")
    parser.add_argument("--workers", type=at_least(0), default=None,
                        help="DataLoader workers (default: the cores; 0: read in the main process)")
    parser.add_argument("--threads", type=at_least(0), default=0,
                        help="intra-op threads of the forward pass, torch's or ONNX Runtime's (default: on the CPU "
                        "the cores the workers leave, at least 1; on CUDA torch's)")
    parser.add_argument("--device", default="auto",
                        help="auto (this rank's GPU, else cpu), cpu, cuda (this rank's GPU), cuda:N")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--weights-format", default="auto",
                        choices=("auto", "onnx", "aoti", "int8", "torchscript", "state_dict"),
                        help="as the server's WEIGHTS_FORMAT: auto on the CPU is the ONNX file under ONNX Runtime "
                        "when the export has one (models/export/choose.py)")
    parser.add_argument("--decode", default="auto", choices=("auto", *PATHS),
                        help="the server's decode path: auto is device on CUDA, tensor on the CPU")
    parser.add_argument("--retry-errors", action="store_true", help="a rerun scores again the files that failed")
    parser.add_argument("--embeddings", type=Path, metavar="EMB.npy",
                        help="also write each scored image's embedding (same forward pass) into EMB.npy: float32, "
                             "N x dim, L2-normalised, rows in the records' order; and their paths, one a line, into "
                             "EMB.names.txt beside it (runs/photos.npy: runs/photos.names.txt), and the model, "
                             "version and --out they are of into EMB.meta.json. A file that cannot be scored has no "
                             "row and no name. Resumes as the records do (EMB.npy's rows kept when EMB.meta.json "
                             "names this run's model and --out); needs a model exported with an embedding")
    return parser


def weights_folder(weights: Path, model: str | None, version: str | None) -> Path:
    """``--weights`` an export, or a repository's ``<model>/<version>`` (its only model, its newest version); a
    path that is neither says which it is not."""
    if not weights.exists():
        raise DataError(f"--weights {weights} does not exist: give an export's folder (with manifest.json) or a "
                        "model repository")
    if is_export(weights):
        if model or version:
            raise DataError(f"{weights} is one export; --model and --version choose within a repository")
        return weights
    names = models(weights)
    if not names:
        near = [folder for folder in (weights / "export", weights.parent, weights.parent / "export")
                if folder != weights and is_export(folder)]  # a run's folder or its checkpoint, for its export
        raise DataError(f"--weights {weights} is not an export (no manifest.json in it) nor a model repository "
                        "(no <model>/<version>/manifest.json under it)" + (
                            f"; {near[0]} is an export: --weights {near[0]}" if near else ""))
    if model is None:
        model = names[0] if len(names) == 1 else named_default(weights)  # the server's default model, as it serves
        if model is None:
            raise DataError(f"{weights} is a repository of {len(names)} models ({', '.join(names)}) and no "
                            "repository.json names its default: name one, --model")
    try:
        folder = weights / model / (version or newest(weights, model))
    except RepositoryError as exc:
        raise DataError(str(exc)) from None
    if not is_export(folder):
        raise DataError(f"{folder} holds no export (manifest.json)")
    return folder


def check_out(out: Path, option: str = "--out", example: str = "scores.jsonl") -> None:
    """``--out`` (or ``option``) can be written: not a folder, its folder made (or there) and writable; DataError if
    not."""
    if out.is_dir():
        raise DataError(f"{option} {out} is a folder: name the file to write in it, e.g. {out / example}")
    folder = out.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        reason = "a file is in the way" if isinstance(exc, (FileExistsError, NotADirectoryError)) else exc.strerror
        raise DataError(f"{option} {out}: its folder {folder} cannot be made ({reason or exc})") from None
    if not os.access(folder, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise DataError(f"{option} {out} cannot be written here (permissions): choose another folder")


def embedding_dim(args: argparse.Namespace, weights: Path, items: list[Item]) -> int:
    """``--embeddings``: the length of the export's embedding, once the file and its names can be written there;
    DataError (before the model loads) when they cannot, or when the export has no embedding."""
    embeddings, names = args.embeddings, names_file(args.embeddings)
    if embeddings.suffix.lower() != EMBEDDINGS_SUFFIX:
        raise DataError(f"--embeddings {embeddings}: write a .npy file (its names go beside it, as X.names.txt "
                        "beside X.npy)")
    check_out(embeddings, "--embeddings", "photos.npy")
    # The names file is split on "\n" alone (read_names), so other characters str.splitlines() splits at pass; a
    # "\r" would break a names file read with its line ends translated (Python's text mode, Windows tools).
    broken = next((item.path for item in items if "\n" in item.path or "\r" in item.path), None)
    if broken is not None:
        raise DataError(f"--embeddings: the input {broken!r} has a line break in its path, and {names} holds one "
                        "path a line: rename it or leave it out of --data")
    manifest = read_checked_manifest(weights)
    if manifest.embedding is None and manifest.torchscript_alone:
        raise DataError(f"--embeddings: {manifest.name} {manifest.version} in {weights} is a TorchScript file "
                        f"exported alone, with no embedding: export the model's state dict with {python_command()} "
                        f"-m models.export --state-dict FILE --arch ARCH, which records it, and score that")
    if manifest.embedding is None:
        raise DataError(f"--embeddings: {manifest.name} {manifest.version} in {weights} was exported without an "
                        f"embedding (written before exports recorded one): export it again with "
                        f"{python_command()} -m models.export, which records it, and score that")
    return manifest.embedding.dim


def rank_device(requested: str, env: DistEnv) -> str:
    """``auto``: this rank's GPU under torchrun (local rank), the GPU, or the CPU; ``cuda``: this rank's GPU (as
    models.train's pick_device), left as it is where CUDA is not available (the load says so); else as given."""
    if requested in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{env.local_rank % torch.cuda.device_count()}"
    return "cpu" if requested == "auto" else requested


def largest_batch(loaded: LoadedModel, cap: int = CUDA_BATCH_CAP) -> int:
    """The largest power of two up to ``cap`` whose forward pass fits in the GPU's memory (CUDA), with room left
    for the batch being prepared beside it."""
    size, fits = 8, 0
    while size <= cap:
        try:
            batch = torch.zeros(size, *loaded.manifest.preprocess.input_shape, device=loaded.device,
                                dtype=loaded.dtype)
            with torch.inference_mode():
                loaded.module(torch.cat([batch, batch]))  # twice the rows: the next batch waits beside it
            fits, size = size, size * 2
        except torch.cuda.OutOfMemoryError:
            break
        finally:
            torch.cuda.empty_cache()
    return max(fits, 1)


@dataclass
class Plan:
    """What this run does: the inputs, this rank's batches, the output and what it already holds."""

    items: list[Item]
    batches: list[list[Item]]
    pending: int
    fmt: str


def plan(args: argparse.Namespace, env: DistEnv, batch_size: int, items: list[Item] | None = None,
         dim: int | None = None, identity: dict[str, str] | None = None) -> Plan:
    """The inputs (``items``, or ``--data`` listed), less what earlier runs wrote (with ``--embeddings``, an image's
    ``dim`` values too: the merged file's rows only when they are of this model and ``--out``, one line says why
    not); this rank's share of the rest. With ``identity`` (the loaded model and version), what earlier runs wrote
    must be that model's answers (DataError). Every rank reads the same files between two barriers, so all see the
    same work and deal it alike."""
    fmt = output_format(args.out)
    items = list_inputs(args.data) if items is None else items
    repair_tail(part_file(args.out, env.rank))
    barrier(env)
    embedded = None
    if dim is not None:
        embedded = set(stored_embeddings(args.out, args.embeddings, dim, identity))
        refused = merged_refusal(args.out, args.embeddings, dim, identity)
        if refused is not None and env.is_main:
            log.warning("--embeddings %s: its rows are not taken (%s); the images are scored again",
                        args.embeddings, refused)
    records = read_records(args.out, fmt)
    barrier(env)
    if identity is not None:
        check_same_model(records, args.out, identity, repository=not is_export(args.weights))
        check_same_top_k(records, args.out, args.top_k)
    done = done_paths(records, args.retry_errors, embedded)
    pending = [item for item in items if item.path not in done]
    return Plan(items, chunks_for_rank(pending, batch_size, env.rank, env.world_size), len(pending), fmt)


def record_identity(loaded: LoadedModel) -> dict[str, str]:
    """The model and version every record names: the loaded export's."""
    return manifest_identity(loaded.manifest)


def top_k(asked: int | None, manifest: Manifest) -> int:
    """The answers per image: ``--top-k`` (DataError above the model's classes, as /predict's top_k is 400), else
    DEFAULT_TOP_K or the model's classes if fewer."""
    classes = manifest.num_classes
    if asked is None:
        return min(DEFAULT_TOP_K, classes)
    if asked > classes:
        raise DataError(f"--top-k {asked}: {manifest.name} {manifest.version} has {classes} classes, so at most "
                        f"{classes} answers an image")
    return asked


def manifest_identity(manifest: Manifest) -> dict[str, str]:
    """The model and version a manifest names, as the records name them."""
    return {"model": manifest.name, "version": manifest.version}


def quiet_handover_errors(worker_id: int) -> None:
    """A DataLoader worker's part of Ctrl-C (its ``worker_init_fn``): a worker hands each batch's tensors over by file
    descriptor, and a main process interrupted in the middle of taking one drops the connection; the worker's
    hand-over thread then printed the broken connection's traceback beside the one line that says what is written.
    Those errors go unprinted; any other is printed as before."""
    printed = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, traceback: object) -> None:
        if not issubclass(kind, (EOFError, ConnectionError, multiprocessing.AuthenticationError)):
            printed(kind, value, traceback)  # type: ignore[arg-type]

    sys.excepthook = hook


def score(plan: Plan, loaded: LoadedModel, args: argparse.Namespace, env: DistEnv, decode: str,
          dim: int | None = None) -> None:
    """This rank's batches through the DataLoader's workers and the model; each batch's records appended (with
    ``dim``, the embeddings of ``--embeddings``, beside them)."""
    mine = [item for batch in plan.batches for item in batch]
    dataset = ScoreSet(mine, loaded.manifest.preprocess, decode)
    workers = args.workers
    loader = DataLoader(dataset, batch_sampler=_batch_positions(plan.batches), collate_fn=collate,
                        num_workers=workers, pin_memory=loaded.device.type == "cuda",
                        prefetch_factor=4 if workers else None, worker_init_fn=quiet_handover_errors)
    identity = record_identity(loaded)
    transform = TensorEvalTransform(loaded.manifest.preprocess)
    writer = PartWriter(part_file(args.out, env.rank), dim)
    bar = tqdm(total=plan.pending, unit="img", disable=not env.is_main or not plan.pending, mininterval=1.0,
               desc="scoring" + (f" (rank 0's pace x {env.world_size})" if env.distributed else ""))
    try:
        for batch in loader:
            index, images = on_device(batch, loaded.device, loaded.dtype, transform)
            records, vectors = (_answers(loaded, images, index, mine, args.top_k, identity, dim is not None)
                                if images is not None else ({}, {}))
            records |= {i: {"path": mine[i].path, "error": reason, **identity} for i, reason in batch["failed"]}
            order = sorted(records)
            writer.write([records[i] for i in order], [vectors.get(i) for i in order] if dim is not None else None)
            bar.update(min(len(records) * env.world_size, bar.total - bar.n))
    finally:
        writer.close()
        bar.close()


def _batch_positions(batches: list[list[Item]]) -> list[list[int]]:
    positions, start = [], 0
    for batch in batches:
        positions.append(list(range(start, start + len(batch))))
        start += len(batch)
    return positions


def _answers(loaded: LoadedModel, images: torch.Tensor, index: list[int], items: list[Item], top_k: int,
             identity: dict[str, str], embed: bool = False) -> tuple[dict[int, Record], dict[int, np.ndarray]]:
    """The forward pass as the server runs it (its dtype, float32 softmax): the top-k of each row, and with
    ``embed`` each row's embedding from the same pass, of unit length in float32 (as the server answers it). A row
    the model answered NaN or infinity in is an error record, as the server fails that image (--retry-errors scores
    it again), never scores of NaN."""
    with torch.inference_mode():
        logits, embedding = split_outputs(loaded.module(images))
        probabilities = logits.float().softmax(dim=1)
        finite = probabilities.isfinite().all(dim=1).cpu().tolist()
        scores, classes = (t.cpu().tolist() for t in probabilities.topk(top_k, dim=1))
        embedded = embed and embedding is not None
        vectors = F.normalize(embedding.float(), dim=1).cpu().numpy() if embedded else None
    labels = loaded.manifest.labels
    records: dict[int, Record] = {}
    rows: dict[int, np.ndarray] = {}
    for row, (i, row_classes, row_scores) in enumerate(zip(index, classes, scores)):
        if not finite[row] or (vectors is not None and not np.isfinite(vectors[row]).all()):
            records[i] = {"path": items[i].path, "error": NON_FINITE, **identity}
            continue
        records[i] = {"path": items[i].path, "labels": [labels[c] for c in row_classes], "scores": row_scores,
                      **identity}
        if vectors is not None:
            rows[i] = vectors[row]
    return records, rows


def report(args: argparse.Namespace, records: list[Record], items: list[Item], loaded: LoadedModel) -> None:
    """With ``--labels``: the evaluation of the merged records, written and printed."""
    labels = Labels(args.labels)
    truths = {item.path: label for item in items if (label := labels.of(item)) is not None}
    check_labels(truths, loaded.manifest.labels)
    result = evaluation(records, truths, loaded.manifest.labels)
    folder = report_folder(args.out, args.report)
    title = f"{loaded.manifest.name} {loaded.manifest.version} on {args.data}"
    files = {item.path: item.file for item in items}
    scored = [files[r["path"]] for r in records if r["path"] in truths and not r.get("error")]
    result["trained_on"] = trained_count(loaded.manifest.trained_on, scored)
    for line in write_report(result, mistakes(records, truths, args.mistakes), truths, files, folder, title):
        log.info("%s", line)
    if result["trained_on"]:  # said again last: the warning before scoring is far above by now
        log.warning("%s", trained_warning(result["trained_on"], result["count"], loaded.manifest, args.labels))


class NothingScored(Exception):
    """Every input failed: the records are written, but a run that scored nothing exits 1 (a script that checks
    the exit code would take a folder of the wrong files, or a model that answers NaN, as done)."""

    def __init__(self, records: list[Record], out: Path) -> None:
        first = records[0]
        super().__init__(f"none of the {len(records)} inputs could be scored: each has its reason in {out} (the "
                         f"first, {first['path']}: {first['error']})")


@dataclass
class Seen:
    """What a run knew when it stopped: the number of inputs (None before they were listed), the length of the
    embeddings it writes (None without --embeddings, or before the manifest was read), and the model and version
    whose embeddings it keeps."""

    inputs: int | None = None
    embedding_dim: int | None = None
    identity: dict[str, str] | None = None  # the model and version the records name, once the manifest was read


def run(args: argparse.Namespace, env: DistEnv, seen: Seen | None = None) -> None:
    """Check what was given, load, plan, score this rank's share, then (rank 0) merge and evaluate."""
    seen = Seen() if seen is None else seen
    weights = weights_folder(args.weights, args.model, args.version)
    items = list_inputs(args.data)  # --data, --out and --labels before the model loads: a mistake costs no load
    seen.inputs = len(items)
    check_out(args.out)
    check_outside(args.data, args.out, "--out")
    check_outside(args.data, args.embeddings, "--embeddings")
    if output_format(args.out) == "parquet":
        check_parquet_names((item.path for item in items), args.out)
    dim = seen.embedding_dim = embedding_dim(args, weights, items) if args.embeddings is not None else None
    manifest = read_checked_manifest(weights)  # what is checked of the model before it loads
    if dim is not None:  # the load names the same: Ctrl-C while it loads still counts the merged rows kept
        seen.identity = manifest_identity(manifest)
    args.top_k = top_k(args.top_k, manifest)
    labels = Labels(args.labels) if args.labels is not None else None
    if labels is not None:
        labels.require_some(items)  # before the model loads
    workers = usable_cores() if args.workers is None else args.workers
    args.workers = workers
    keep_freed_memory(DEFAULT_TRIM_THRESHOLD_MB)  # before any image is decoded; the DataLoader's workers inherit it
    device = rank_device(args.device, env)
    # Given to torch and, like the server's, to the ONNX Runtime session at load.
    threads = forward_threads(args.threads, device, workers=workers, decoders_apart=True)
    # The group first: on CUDA it makes this rank's GPU the current one, so nothing the load puts on "the current
    # GPU" lands on GPU 0.
    init_process_group(env, resolve_device(device))
    loaded = load_model(weights, weights_format=args.weights_format, device=device, dtype=args.dtype,
                        jit_optimize=True, max_batch_size=max(args.batch_size, 1), threads=threads or 1)
    if threads:
        torch.set_num_threads(threads)
    if labels is not None:  # a wrong class name stops the run before any image is scored
        labelled = {i.file: lab for i in items if (lab := labels.of(i))}
        check_labels(labelled, loaded.manifest.labels, split=labels.split_folder())
        trained = trained_count(loaded.manifest.trained_on, labelled) if env.is_main else None
        if trained:
            log.warning("%s", trained_warning(trained, len(labelled), loaded.manifest, args.labels, read=False))
    batch_size = args.batch_size or (largest_batch(loaded) if loaded.device.type == "cuda" else CPU_BATCH)
    identity = record_identity(loaded)
    args.decode = args.decode if args.decode != "auto" else "device" if loaded.device.type == "cuda" else "tensor"
    held = hold_output(args.out) if env.is_main else None  # before any rank repairs or reads what is written
    try:
        if held is not None:
            check_same_options(args.out, {"weights_format": loaded.weights_format, "decode": args.decode,
                                          "dtype": str(loaded.dtype).removeprefix("torch.")})
        barrier(env)
        _score_and_merge(args, env, loaded, plan(args, env, batch_size, items, dim, identity), batch_size, dim,
                         identity)
    finally:
        if held is not None:  # no lock file left beside the output, however the run ends (taken off still held)
            Path(held.name).unlink(missing_ok=True)
            held.close()


def _score_and_merge(args: argparse.Namespace, env: DistEnv, loaded: LoadedModel, work: Plan, batch_size: int,
                     dim: int | None, identity: dict[str, str]) -> None:
    """``run``'s second half, while rank 0 holds the output: score this rank's share, then (rank 0) merge and
    evaluate."""
    decode = args.decode
    if env.is_main:
        log.info("%s %s (%s, %s, %s) on %d of %d inputs (%d written before), batch %d, %s decode path, %d rank(s)",
                 loaded.manifest.name, loaded.manifest.version, loaded.weights_format, loaded.device,
                 str(loaded.dtype).removeprefix("torch."), work.pending, len(work.items),
                 len(work.items) - work.pending, batch_size, decode, env.world_size)
    score(work, loaded, args, env, decode, dim)
    barrier(env)
    if env.is_main:
        records = merged_records(args.out, work.fmt, {item.path: i for i, item in enumerate(work.items)})
        if dim is not None:
            merge_embeddings(args, records, dim, identity)
        records = write_merged(args.out, work.fmt, records)
        failed = sum(1 for r in records if r.get("error"))
        log.info("wrote %s: %d lines, %d of them unreadable files", args.out, len(records), failed)
        if failed == len(records) and failed:
            raise NothingScored(records, args.out)
        if args.labels is not None:
            report(args, records, work.items, loaded)


def merge_embeddings(args: argparse.Namespace, records: list[Record], dim: int, identity: dict[str, str]) -> None:
    """``--embeddings``, its names and meta file written from the parts and what it held (rank 0, before the parts
    go)."""
    rows = write_embeddings(records, args.out, args.embeddings, dim, identity)
    log.info("wrote %s: %d embeddings of %d values, their paths in %s", args.embeddings, rows, dim,
             names_file(args.embeddings))
    missing = sum(1 for r in records if not r.get("error")) - rows
    if missing:  # never when the model answers its embedding: a run scores every image that has no row yet
        log.warning("%d scored images have no row in %s: the model answered no embedding for them", missing,
                    args.embeddings)


def written(out: Path, embeddings: Path | None = None, dim: int | None = None,
            identity: dict[str, str] | None = None) -> int:
    """How many inputs ``out`` and its part files hold (each counted once), as a rerun would skip them (with
    ``embeddings``, an image's ``dim`` values of ``identity``'s model must be written too)."""
    try:
        embedded = (set(stored_embeddings(out, embeddings, dim, identity)) if embeddings is not None and dim
                    else None)
        return len(done_paths(read_records(out, output_format(out)), embedded=embedded))
    except Exception:  # noqa: BLE001 - a count for the stop line; never a second error after Ctrl-C
        return 0


def stopped(args: argparse.Namespace, argv: list[str], env: DistEnv, seen: Seen) -> str:
    """What Ctrl-C leaves, in one line: how many inputs are written, where, and the exact command that goes on."""
    done = written(args.out, args.embeddings, seen.embedding_dim, seen.identity)
    command = rerun_command("models.predict", argv, env.world_size)
    if not done:
        return f"stopped before any image was scored; to start again: {command}"
    total = f" of {seen.inputs}" if seen.inputs is not None else ""
    where = parts_dir(args.out) if parts_dir(args.out).is_dir() else args.out
    return (f"stopped: {done}{total} inputs are written ({where}); to go on with the rest (a rerun skips what "
            f"is written): {command}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for ``python -m models.predict`` and torchrun; returns the exit code."""
    args = get_args_parser().parse_args(argv)
    env = env_from_torchrun()
    logging.basicConfig(level=logging.INFO if env.is_main else logging.WARNING,
                        format=f"%(asctime)s rank{env.rank} %(levelname)s %(message)s")
    seen = Seen()
    try:
        with terminated_as_interrupt():
            run(args, env, seen)
    except (DataError, ModelLoadError) as exc:
        log.error("error: %s", exc)
        return 2
    except NothingScored as exc:
        log.error("error: %s", exc)
        return 1
    except OSError as exc:  # an output that could not be written (a full disk): what is written is kept
        log.error("error: %s: what was written before is kept; where a disk is full, make room and run the same "
                  "command again", exc)
        return 3
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: one line with what is written and the command that goes
        if env.is_main:  # on, not a traceback
            log.warning("%s", stopped(args, list(sys.argv[1:] if argv is None else argv), env, seen))
        return exit_status(exc)
    finally:
        destroy_process_group(env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
