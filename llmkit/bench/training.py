"""Measuring a training step: tokens/s and model FLOPs utilization (MFU).

The step timed is the trainer's own (:class:`llmkit.training.TrainStep`): autocast, the
spec's objective, backward (a grad scaler for fp16), clipping, the optimizer step and the
non-finite check, on one process with one micro-batch of random tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmkit import hardware
from llmkit.model import Transformer, build_model
from llmkit.model.objective import Objective
from llmkit.spec import ResolvedSpec
from llmkit.training.step import TrainStep, resolve_precision
from llmkit.training.strategy import ParallelStrategy


@dataclass
class StepTiming:
    seconds: float  # median seconds per optimizer step
    tokens_per_s: float
    flops_per_s: float
    mfu: float | None
    precision: str


def build_training_step(
    rs: ResolvedSpec, batch_size: int, seq_len: int, precision: str, device: str = "cpu"
) -> tuple[Callable[[], float], Transformer]:
    """A closure running one optimizer step of the trainer's :class:`TrainStep` on a fixed
    random batch (clipping at ``train.grad_clip``, one micro-batch), plus the model.
    ``precision`` may be ``auto`` (resolved as the trainer does); the step returns the loss
    (reading it waits for the device)."""
    dev = torch.device(device)
    precision = resolve_precision(precision, dev, rs, batch_size * seq_len)
    if dev.type == "cpu" and rs.spec.train.reuse_freed_memory:
        hardware.reuse_freed_memory()  # as the trainer does
    torch.manual_seed(0)
    model = build_model(rs).to(dev).train()
    optimizer = rs.optimizer.build(model, rs.optimizer.options)
    step = TrainStep(
        model,
        optimizer,
        objective=Objective.from_spec(rs),
        strategy=ParallelStrategy.single(dev),
        precision=precision,
        grad_clip=rs.spec.train.grad_clip,
    )
    vocab = rs.model.vocab_size
    x = torch.randint(0, vocab, (batch_size, seq_len)).to(dev)
    y = torch.randint(0, vocab, (batch_size, seq_len)).to(dev)

    def run() -> float:
        return step(lambda: (x, y)).loss

    return run, model


def time_training_step(
    rs: ResolvedSpec,
    batch_size: int,
    seq_len: int,
    precision: str = "auto",
    repeats: int = 5,
    device: str = "cpu",
) -> StepTiming:
    """Median time of ``repeats`` training steps after two warm-up steps; MFU against the
    measured matmul peak on CPU and the data-sheet peak of known GPUs."""
    dev = torch.device(device)
    precision = resolve_precision(precision, dev, rs, batch_size * seq_len)
    step, model = build_training_step(rs, batch_size, seq_len, precision, device)
    for _ in range(2):
        step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    median = sorted(times)[len(times) // 2]
    tps = batch_size * seq_len / median
    flops = model.flops_per_token(seq_len)["train"] * tps
    peak = hardware.peak_flops(dev, precision)
    return StepTiming(median, tps, flops, flops / peak if peak else None, precision)
