"""The trainable model, its optimiser and learning-rate schedule, from the training options."""
from __future__ import annotations

import argparse
import warnings
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from models.architectures import build_model, class_sized
from models.run.start_weights import with_body
from models.pretrained import build_pretrained


def build_trainable(args: argparse.Namespace, num_classes: int, device: torch.device) -> nn.Module:
    """``args.arch`` with a ``num_classes`` head: from the packaged ImageNet weights, from the body of the weights
    models.train's set-up read from ``--weights`` (``args._start_body``, dropped once loaded), or from scratch."""
    model = build_pretrained(args.arch, num_classes) if args.pretrained else build_model(args.arch, num_classes)
    body = vars(args).pop("_start_body", None)
    if body is not None:
        with_body(model, body)
    if args.freeze_backbone:
        head = set(map(id, head_parameters(model, args.arch)))
        for param in model.parameters():
            param.requires_grad_(id(param) in head)
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    return model.to(device, memory_format=memory_format)


def head_parameters(model: nn.Module, arch: str) -> list[nn.Parameter]:
    """``model``'s parameters sized by its class count (``class_sized``: the head, and an auxiliary one), in order."""
    sized = class_sized(arch)
    return [param for name, param in model.named_parameters() if name in sized]


def set_train_mode(model: nn.Module, freeze_bn: bool) -> None:
    """Training mode, except that frozen BatchNorm layers keep using (and keeping) their running statistics.

    Freezing them suits a frozen backbone (its statistics came from ImageNet) and tiny per-device batches, whose
    batch statistics are noise.
    """
    model.train()
    if freeze_bn:
        for module in model.modules():
            if isinstance(module, _BatchNorm):
                module.eval()


def make_optimizer(model: nn.Module, args: argparse.Namespace, *, fused: bool = False) -> torch.optim.Optimizer:
    """SGD (momentum) or AdamW; the backbone learns at ``lr * backbone_lr_scale``, the new head at ``lr``.

    ``fused``: torch's fused kernels (one launch updates every parameter; the training script asks for them on
    CUDA, where ``python -m bench.training.train`` measures them)."""
    head = head_parameters(model, args.arch)
    head_ids = set(map(id, head))
    backbone = [p for p in model.parameters() if p.requires_grad and id(p) not in head_ids]
    groups = [{"params": head, "lr": args.lr}]
    if backbone:
        groups.append({"params": backbone, "lr": args.lr * args.backbone_lr_scale})
    if args.opt == "adamw":
        return torch.optim.AdamW(groups, lr=args.lr, weight_decay=args.weight_decay, fused=fused or None)
    return torch.optim.SGD(groups, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                           fused=fused or None)


Scheduler = torch.optim.lr_scheduler.LRScheduler


class SchedulePlan(NamedTuple):
    """What a run's schedule is laid over: its epochs and how many of the first warm up. Two runs with the same plan
    have schedules of the same shape (the one's state loads into the other's)."""

    epochs: int
    warmup: int


def schedule_plan(epochs: int, lr_warmup_epochs: int) -> SchedulePlan:
    """The plan of a run of ``epochs`` asked for ``lr_warmup_epochs`` of warm-up: at most all epochs but the last (a
    1-epoch run has none, its schedule is the cosine alone)."""
    return SchedulePlan(epochs, min(lr_warmup_epochs, max(epochs - 1, 0)))


def make_scheduler(optimizer: torch.optim.Optimizer, args: argparse.Namespace) -> Scheduler:
    """Cosine decay over the epochs, after an optional linear warm-up; stepped once per epoch."""
    warmup = schedule_plan(args.epochs, args.lr_warmup_epochs).warmup
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(args.epochs - warmup, 1))
    if not warmup:
        return cosine
    ramp = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=warmup)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [ramp, cosine], milestones=[warmup])


def continue_schedule(optimizer: torch.optim.Optimizer, args: argparse.Namespace, epoch: int) -> Scheduler:
    """The schedule of a run planned for ``args.epochs``, advanced to ``epoch`` (for a resumed run whose plan
    changed): each group's learning rate restarts from its initial value and steps as that run's would have. Whatever
    schedule the optimiser had (its shape need not be this one's), only its groups' ``initial_lr`` is read."""
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"]
        del group["initial_lr"]  # the new scheduler records it again
    scheduler = make_scheduler(optimizer, args)
    with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": this is a fast-forward
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(epoch):
            scheduler.step()
    return scheduler
