"""Train or fine-tune a classifier on an image folder; the result is served by ``app/`` unchanged.

    .venv/bin/python -m models.train --data data/digits --arch resnet18 --epochs 8 --output-dir runs/digits
    torchrun --nproc_per_node=2 -m models.train --data DIR ...        # DDP: NCCL on GPUs, gloo on CPUs

``DIR`` holds ``<class>/*`` (a share of each class held out for validation: ``--val-split``, 0.2 by default), or
``train/<class>/*`` and ``val/<class>/*``. Each epoch writes ``checkpoint.pt`` (and ``best.pt`` when
val top-1 improved) and a line of ``metrics.jsonl`` in ``--output-dir``; ``--resume`` continues a stopped run.
"""
from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from tqdm import tqdm

from models.architectures import ARCHS
from models.data.gpu import DevicePrefetcher
from models.data.loaders import Data, load_data
from models.export.manifest import TOP5_MIN_CLASSES
from models.export.repository import check_name, name_from
from models.presets import EvalPreset
from models.pretrained import pretrained_preset
from models.run import checkpoint as ckpt
from models.run.batchnorm import recompute_bn_stats
from models.run.amp import AmpDtype, autocast, backward_and_step, check_amp, make_scaler, use_tf32
from models.run.args import DataError, get_args_parser
from models.run.confusion import confusion, confusion_counts, write_confusion
from models.run.device_stats import AsyncScalar, peak_memory, reset_peak_memory
from models.run.distributed import (
    DistEnv,
    barrier,
    destroy_process_group,
    env_from_torchrun,
    exit_status,
    init_process_group,
    pick_device,
    sum_across_ranks,
    terminated_as_interrupt,
)
from models.run.optim import build_trainable, make_optimizer, make_scheduler, set_train_mode
from models.run.start_weights import start_from
from models.run.reference import reference_counts, reference_from_counts
from models.run.report import HELD_OUT_NAME, Progress, RunLog, Timer, process_started, write_held_out

log = logging.getLogger("models.train")


class RunFinished(Exception):
    """``--resume`` of a run that already trained all its epochs: nothing to do (said, exit 0)."""


@dataclass
class EvalResult:
    """Validation metrics over all ranks, and this rank's softmax outputs in its sample order."""

    loss: float
    acc1: float
    acc5: float
    count: int
    probabilities: torch.Tensor
    indices: list[int]


def _amp_dtype(args: argparse.Namespace) -> AmpDtype | None:
    return (args.amp_dtype or "bf16") if args.amp else None


def make_preset(args: argparse.Namespace) -> EvalPreset:
    """The pretrained weights' normalisation, or ImageNet's, or --mean and --std; sizes and interpolation from the
    options. A ``--crop-size`` alone resizes in the preset's proportion (``EvalPreset.given``): the default resize of
    256 evaluated the centre 1/8 of the image at --crop-size 32, and padded a crop of 300 with black. ValueError
    when the crop is larger than the resize."""
    base = pretrained_preset(args.arch) if args.pretrained else EvalPreset(resize_size=256, crop_size=224)
    preset = base.given(args.resize_size, args.crop_size, args.interpolation, args.mean, args.std)
    if preset.crop_size > preset.resize_size:
        raise ValueError(f"--crop-size {preset.crop_size} is larger than --resize-size {preset.resize_size}: the "
                         f"centre crop would be padded with black; give a --resize-size of at least the crop")
    return preset


@dataclass
class Parts:
    """What a run trains with: the plain module (checkpoints, evaluation), the module the step runs (compiled
    and/or wrapped in DDP), the optimiser and the fp16 scaler."""

    model: nn.Module
    step_model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None


def build_parts(args: argparse.Namespace, num_classes: int, device: torch.device, env: DistEnv = DistEnv(), *,
                fused: bool | None = None) -> Parts:
    """The model, optimiser and scaler of a run (also what ``python -m bench.training.train`` measures). ``fused``:
    torch's fused optimiser kernels, by default on CUDA only."""
    use_tf32(device, args.tf32)
    model = step_model = build_trainable(args, num_classes, device)
    if args.compile:  # the step runs the compiled graph; checkpoints and evaluation use the plain module
        step_model = torch.compile(model)
    if env.distributed:
        step_model = nn.parallel.DistributedDataParallel(step_model,
                                                         device_ids=[device] if device.type == "cuda" else None)
    optimizer = make_optimizer(model, args, fused=device.type == "cuda" if fused is None else fused)
    return Parts(model, step_model, optimizer, make_scaler(device, _amp_dtype(args)))


def train_step(model: nn.Module, images: torch.Tensor, targets: torch.Tensor, optimizer: torch.optim.Optimizer,
               scaler: torch.amp.GradScaler | None, args: argparse.Namespace,
               trainable: list[nn.Parameter]) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimisation step on a batch already on the device; returns the (still queued) loss and logits.

    Nothing here waits for the GPU: no ``.item()``, no host copy, so the host runs ahead and queues the next step.
    """
    device = images.device
    with autocast(device, _amp_dtype(args)):
        logits = model(images)
        loss = F.cross_entropy(logits, targets, label_smoothing=args.label_smoothing)
    backward_and_step(loss, optimizer, scaler=scaler, parameters=trainable, clip_grad_norm=args.clip_grad_norm)
    return loss.detach(), logits.detach()


BATCHNORM_ONE_VALUE = "Expected more than 1 value per channel"  # torch's BatchNorm, given one value a channel


def _one_value_a_channel(batch: int, args: argparse.Namespace) -> DataError:
    """torch's BatchNorm refusing a batch whose feature map holds one value a channel (a batch of one image at a
    crop its network shrinks to 1x1: --batch-size 1 at --crop-size 32 on resnet18) as a DataError saying what to
    change (before: a traceback)."""
    return DataError(f"a batch of {batch} image at --crop-size {args.crop_size} leaves {args.arch}'s BatchNorm one "
                     f"value a channel to train on, which it cannot: use --batch-size 2 or more, a larger "
                     f"--crop-size, or --freeze-bn")


def train_one_epoch(model: nn.Module, data: Data, optimizer: torch.optim.Optimizer,
                    scaler: torch.amp.GradScaler | None, device: torch.device, epoch: int,
                    args: argparse.Namespace, env: DistEnv) -> dict[str, float]:
    """One pass over this rank's shard; returns loss, top-1 and images/s over all ranks (and peak GPU memory)."""
    set_train_mode(model, args.freeze_bn or args.freeze_backbone)
    trainable = [p for p in model.parameters() if p.requires_grad]
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    correct = torch.zeros((), device=device, dtype=torch.int64)
    shown = AsyncScalar(device)
    seen, start = 0, time.perf_counter()
    batches = DevicePrefetcher(data.train, data.prepare, device)
    # a bar on a terminal only: in a redirected log its frames shared each line with the epoch's summary
    bar = tqdm(batches, desc=f"epoch {epoch + 1}", unit="batch", disable=not env.is_main or not sys.stderr.isatty(),
               leave=False, mininterval=1.0)
    for images, targets in bar:
        try:
            loss, logits = train_step(model, images, targets, optimizer, scaler, args, trainable)
        except ValueError as exc:
            if BATCHNORM_ONE_VALUE not in str(exc):
                raise
            raise _one_value_a_channel(len(targets), args) from None
        # Accumulated on the device and read once per epoch: a .item() per step would stall the GPU queue.
        loss_sum += loss.double() * len(targets)
        correct += (logits.argmax(1) == targets).sum()
        seen += len(targets)
        if env.is_main:  # the newest loss whose copy has landed, never waiting for one; drawn at tqdm's pace
            shown.push(loss)
            bar.set_postfix(loss=shown.text(), lr=f"{optimizer.param_groups[0]['lr']:.3g}", refresh=False)
    elapsed = time.perf_counter() - start
    total_loss, total_correct, total_seen, slowest = sum_across_ranks(
        [loss_sum.item(), float(correct.item()), float(seen), elapsed], device, env)
    if not math.isfinite(total_loss):
        # A resumed run takes a new --lr (models/run/checkpoint.py): going on from the last checkpoint works. Its
        # writer has finished by the time main() reports this (run() waits for it on the way out).
        go_on = (f", then resume from epoch {epoch}'s checkpoint with the new value: --resume "
                 f"{args.output_dir / ckpt.CHECKPOINT_NAME}" if epoch > 0 else "")
        raise DataError(f"the training loss became {total_loss} in epoch {epoch + 1}; lower --lr or use "
                        f"--clip-grad-norm{go_on}")
    # Ranks run in lock-step, so the job's wall time is about the mean of the ranks' times.
    wall = slowest / env.world_size
    return {"train_loss": total_loss / total_seen, "train_acc1": total_correct / total_seen,
            "images_per_s": total_seen / wall if wall else 0.0, **peak_memory(device)}


@torch.inference_mode()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device, env: DistEnv) -> EvalResult:
    """Validation the way the server predicts: eval mode, fp32, the shared eval transform."""
    model.eval()
    num_classes, loss_sum, top1, top5 = 0, 0.0, 0, 0
    outputs: list[torch.Tensor] = []
    for images, targets in loader:
        images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        logits = model(images).float()
        num_classes = logits.shape[1]
        loss_sum += F.cross_entropy(logits, targets, reduction="sum").item()
        ranked = logits.topk(min(5, num_classes), dim=1).indices
        top1 += (ranked[:, 0] == targets).sum().item()
        top5 += (ranked == targets[:, None]).any(dim=1).sum().item()
        outputs.append(logits.softmax(dim=1).cpu())
    loss_sum, top1, top5, count = sum_across_ranks([loss_sum, top1, top5, sum(len(o) for o in outputs)], device, env)
    count = max(int(count), 1)
    return EvalResult(loss=loss_sum / count, acc1=top1 / count, acc5=top5 / count, count=count,
                      probabilities=torch.cat(outputs) if outputs else torch.empty(0),
                      indices=list(loader.sampler))


def _setup(args: argparse.Namespace, env: DistEnv) -> tuple[torch.device, EvalPreset]:
    """Resolve the defaults that depend on other options (a resumed run's own first: its checkpoint's, where not
    given); refuse combinations that cannot work, as user errors rather than tracebacks."""
    resumed = ckpt.resumed_run(args)
    args.lr_from_batch = args.lr is None  # (saved: a resume derives it again, for its own global batch)
    if args.lr is None:  # sane from a small folder to ImageNet: a batch of 32 on one process trains at 0.0125
        args.lr = 0.1 * args.batch_size * env.world_size / 256 if args.opt == "sgd" else 1e-3
    if args.lr_warmup_epochs is None:  # fresh BatchNorm statistics and a full learning rate diverged on day one
        args.lr_warmup_epochs = 0 if args.pretrained or args.weights is not None else 1
    try:
        device = pick_device(args.device, env)
        if args.amp_dtype is not None and not args.amp:  # (it did nothing: the run trained in float32, unsaid)
            raise ValueError(f"--amp-dtype {args.amp_dtype} without --amp does nothing: add --amp for mixed "
                             "precision, or leave --amp-dtype out")
        check_amp(device, _amp_dtype(args))
        if args.freeze_backbone and args.backbone_lr_scale != 1.0:  # (it did nothing: the backbone does not train)
            raise ValueError(f"--backbone-lr-scale {args.backbone_lr_scale:g} with --freeze-backbone does nothing: "
                             "the backbone does not train; leave one of them out (--backbone-lr-scale 0.1 alone "
                             "fine-tunes everything, the backbone slower)")
        start_from(args)
        if args.freeze_backbone and not args.pretrained and args.weights is None:
            log.warning("--freeze-backbone without --pretrained or --weights trains the head alone on a backbone of "
                        "random weights: add --pretrained (efficientnet_lite0) to fine-tune ImageNet's, --weights "
                        "FILE to fine-tune your own, or leave --freeze-backbone out to train all of it")
        if args.name is not None:  # refused now, not at the export after the last epoch
            check_name("model", args.name)
        if args.sync_bn and device.type != "cuda":
            raise ValueError("--sync-bn needs CUDA (torch's SyncBatchNorm runs on GPUs); leave it out on CPUs (under "
                             "torchrun there, each epoch's BatchNorm statistics are recomputed and averaged across the "
                             "processes)")
        preset = make_preset(args)
        if args.resume is not None:
            ckpt.check_resumed_preset(args.resume, resumed, preset)
        _check_export_target(args)
        return device, preset
    except ValueError as exc:
        raise DataError(str(exc)) from None


def _check_export_target(args: argparse.Namespace) -> None:
    """Refuse, before the first epoch, an export the end of the run would refuse: both targets at once (a run
    exports to one: --export was dropped), a folder that already holds an export or is a file, a repository that
    is a Python package or a file. ValueError."""
    if args.export is None and args.export_repository is None:
        return
    if args.export is not None and args.export_repository is not None:
        raise ValueError("--export and --export-repository both given: a run exports to one of them")
    from models.export.publish import held_by
    from models.export.write import target

    chosen = args.export if args.export is not None else args.export_repository
    existing = next((p for p in (chosen, *chosen.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ValueError(f"{chosen} cannot be a folder to export into: {existing} is a file")
    folder, _ = target(args.export, args.export_repository, model_name(args), None)
    found = held_by(folder) if args.export is not None else None
    if found is not None:
        raise ValueError(f"--export {folder} already holds {found}: export into a new folder (or use "
                         f"--export-repository DIR for numbered versions)")


def run(args: argparse.Namespace, env: DistEnv, device: torch.device, preset: EvalPreset,
        started: float | None = None) -> bool:
    """Train ``args.epochs`` epochs (from a checkpoint when resuming), then report, export and plot; the summary's
    whole time counts from ``started`` (``time.perf_counter()``; default: now). False when the export asked for
    failed (the run is kept, the summary says how to export it)."""
    started = time.perf_counter() if started is None else started
    torch.manual_seed(args.seed)
    ckpt.check_fresh_output(args)
    data = load_data(args, preset, env, device)
    parts = build_parts(args, len(data.classes), device, env)
    model, model_without_ddp, optimizer, scaler = parts.step_model, parts.model, parts.optimizer, parts.scaler
    barrier(env)  # every rank checked --output-dir (check_fresh_output) before the main one carries a run into it
    start, best, scheduler, planned = ckpt.start_or_resume(args, model_without_ddp, optimizer,
                                                           make_scheduler(optimizer, args), scaler, data.classes,
                                                           is_main=env.is_main)
    if start >= args.epochs:
        if start < planned:  # stopped early, resumed with an --epochs it has already passed
            raise RunFinished(f"{args.resume} stopped after {start} of its {planned} planned epochs (best val top-1 "
                              f"{best.acc1:.4f}); --epochs {args.epochs} trains no more. To go on: --resume "
                              f"{args.resume} --epochs {planned}")
        raise RunFinished(f"{args.resume} is a finished run of {start} epochs (best val top-1 {best.acc1:.4f}); "
                          f"nothing to train. To train longer: --resume {args.resume} --epochs {start + 5}")
    best = _best_on_this_holdout(args, best, start, model_without_ddp, data, device, env)
    if env.is_main:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        if args.val_split is not None:  # one folder split: which images it validates on, to evaluate on them alone
            log.info("wrote %s: the %d images held out", write_held_out(args.output_dir, data.val_files),
                     len(data.val_files))
    runlog, timer = RunLog(args.output_dir, enabled=env.is_main), Timer()
    progress = Progress(args.epochs, len(data.classes))
    writer = ckpt.CheckpointWriter()
    try:
        for epoch in range(start, args.epochs):
            data.train_sampler.set_epoch(epoch)
            lr = optimizer.param_groups[0]["lr"]
            reset_peak_memory(device)
            row = train_one_epoch(model, data, optimizer, scaler, device, epoch, args, env)
            scheduler.step()
            if not (args.freeze_bn or args.freeze_backbone):  # statistics of this epoch's weights, not the past's
                recompute_bn_stats(model_without_ddp, DevicePrefetcher(data.train, data.prepare, device),
                                   args.bn_recompute_batches, env)
            result = evaluate(model_without_ddp, data.val, device, env)
            # Below 6 classes top-5 is 1.0 by construction: null, not a figure a reader takes for an accuracy.
            row = {"epoch": epoch, "lr": lr, **row, "val_loss": result.loss, "val_acc1": result.acc1,
                   "val_acc5": result.acc5 if len(data.classes) >= TOP5_MIN_CLASSES else None}
            reference = _prediction_reference(result, len(data.classes), device, env)
            is_best = ckpt.better(result.acc1, result.loss, best)
            if is_best:
                best = ckpt.Best(result.acc1, result.loss, row, _confusion_counts(result, data, device, env))
            if env.is_main:  # written by a thread while the next epoch trains
                writer.save(ckpt.checkpoint_state(model_without_ddp, optimizer, scheduler, scaler, epoch, best,
                                                   args, data.classes, preset, row, reference),
                            args.output_dir, is_best=is_best)
                runlog.epoch(row)
                log.info("%s", progress.line(row, is_best, timer.lap()))
            barrier(env)
    finally:
        writer.wait()  # the last checkpoint is on disk before the export, a resume hint or the exit
    runlog.close()
    return _finish(args, progress, best, data.classes, started) if env.is_main else True


def _best_on_this_holdout(args: argparse.Namespace, best: ckpt.Best, start: int, model: nn.Module, data: Data,
                          device: torch.device, env: DistEnv) -> ckpt.Best:
    """A resumed run's best epoch measured again on the images this run validates on, where they changed since its
    checkpoint (images added to the folder or gone from it): its figures, of other images, could not be compared with
    the coming epochs', so one better on these could lose to a number of those (a data scientist's trial). As it
    was where they did not change, or where its weights are not there to measure (said)."""
    before = getattr(args, "_resumed_sides", None)
    if before is None or best.row is None or before[0] == args._split_sides[0]:
        return best
    epoch = int(best.row["epoch"])
    weights = None if epoch == start - 1 else ckpt.best_weights(args, epoch)
    found = epoch == start - 1 or weights is not None
    if sum_across_ranks([float(found)], device, env)[0] < env.world_size:  # every rank measures, or none: together
        log.warning("the held-out images changed since %s, and its best epoch %d's weights are not in the best.pt "
                    "beside it: its figures, of the old ones, stay the ones to beat", args.resume, epoch + 1)
        return best
    kept = None
    if weights is not None:
        kept = {name: value.clone() for name, value in model.state_dict().items()}
        model.load_state_dict(weights)
    result = evaluate(model, data.val, device, env)
    counts = _confusion_counts(result, data, device, env)
    reference = _prediction_reference(result, len(data.classes), device, env)
    if kept is not None:
        model.load_state_dict(kept)
    added, gone = len(args._split_sides[0] - before[0]), len(before[0] - args._split_sides[0])
    log.info("the held-out images changed since %s (%d added, %d gone): its best epoch %d (val loss %.4f, top-1 %.4f "
             "on the old ones) measured again on these: val loss %.4f, top-1 %.4f", args.resume, added, gone,
             epoch + 1, best.loss, best.acc1, result.loss, result.acc1)
    row = {**best.row, "val_loss": result.loss, "val_acc1": result.acc1,
           "val_acc5": result.acc5 if len(data.classes) >= TOP5_MIN_CLASSES else None}
    best = ckpt.Best(result.acc1, result.loss, row, counts)
    if env.is_main:  # what the export takes from best.pt: of these images too, as the summary is
        ckpt.remeasured_best(args.output_dir / ckpt.BEST_NAME, best, reference)
    return best


def _confusion_counts(result: EvalResult, data: Data, device: torch.device, env: DistEnv) -> torch.Tensor:
    """The confusion matrix of this validation pass over all ranks."""
    samples = data.val.dataset.samples  # type: ignore[attr-defined]
    local = confusion_counts(result.probabilities, [samples[i][1] for i in result.indices], len(data.classes))
    summed = sum_across_ranks([float(v) for v in local.flatten().tolist()], device, env)
    return torch.tensor(summed, dtype=torch.int64).reshape(local.shape)


def _prediction_reference(result: EvalResult, num_classes: int, device: torch.device,
                          env: DistEnv) -> dict[str, object] | None:
    """This validation pass's top-1 class counts and confidence histogram over all ranks, for the manifest."""
    summed = sum_across_ranks(reference_counts(result.probabilities, num_classes), device, env)
    return reference_from_counts(summed, num_classes)


def _finish(args: argparse.Namespace, progress: Progress, best: ckpt.Best, classes: list[str],
            started: float) -> bool:
    """The best epoch's per-class report (an epoch before a resume's too: the checkpoint keeps it), the export asked
    for, the plot, then the summary: the whole command's time (the export included) and the command that serves
    what was exported, or the export to run first. False when the export asked for failed."""
    if best.confusion is not None:
        path, table = write_confusion(confusion(best.confusion, classes), args.output_dir)
        log.info("per class, best epoch (%s):\n%s", path, "\n".join(table))
    best_path = args.output_dir / ckpt.BEST_NAME
    exported = _export(args, best_path) if args.export or args.export_repository else None
    if args.plot:
        from models.plot import plot_run
        log.info("wrote %s", plot_run(args.output_dir))
    held_out = args.output_dir / HELD_OUT_NAME
    validated_on = (held_out, args.data) if args.val_split is not None else (args.data / "val", args.data / "val")
    for line in progress.summary(best.row, best_path, exported, args.export_repository or args.export,
                                 model_name(args), total_seconds=time.perf_counter() - started,
                                 validated_on=validated_on):
        log.info("%s", line)
    return exported is not None or not (args.export or args.export_repository)


def model_name(args: argparse.Namespace) -> str:
    """The name the run exports under: ``--name`` (checked in ``_setup``), else its ``--output-dir``'s name made a
    valid one (``runs/resnet+aug``: resnet-aug)."""
    return args.name or name_from(args.output_dir.name)


def _export(args: argparse.Namespace, best: Path) -> Path | None:
    """``--export`` or ``--export-repository``: the folder written, or None when the export was refused."""
    from models.export.write import export_checkpoint

    try:
        # With its ONNX file: what the server runs on a CPU (docs/performance.md); a GPU package is compiled
        # separately (python -m models.export --checkpoint ... --packages onnx,cuda).
        manifest = export_checkpoint(best, args.export, name=model_name(args), repository=args.export_repository,
                                     packages=[("onnx", "float32")])
    except (FileExistsError, ValueError) as exc:  # the run is kept: say how to export it, do not fail after training
        log.error("not exported: %s", exc)
        return None
    if args.export_repository:
        return args.export_repository / manifest.name / manifest.version
    return args.export


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for ``python -m models.train`` and torchrun; returns the process exit code."""
    # The command's whole time from the process's start (interpreter and imports); called in process: from now.
    started = process_started() if argv is None else time.perf_counter()
    args = get_args_parser(ARCHS, __doc__ or "").parse_args(argv)
    env = env_from_torchrun()
    logging.basicConfig(level=logging.INFO if env.is_main else logging.WARNING,
                        format=f"%(asctime)s rank{env.rank} %(levelname)s %(message)s")
    try:
        with terminated_as_interrupt():
            device, preset = _setup(args, env)
            init_process_group(env, device)
            if not run(args, env, device, preset, started):
                return 2  # the export asked for failed: said in its line, the summary says how to export the run
    except RunFinished as exc:
        log.info("%s", exc)
    except (DataError, FileNotFoundError) as exc:
        log.error("error: %s", exc)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: one line with what to run next, not a traceback
        if env.is_main:
            log.warning("%s", ckpt.interrupted(args, list(sys.argv[1:] if argv is None else argv), env.world_size))
        return exit_status(exc)
    finally:
        destroy_process_group(env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
