"""Measuring a training step: tokens/s and model FLOPs utilization (MFU)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from llmkit import hardware
from llmkit.model import build_model
from llmkit.spec import ResolvedSpec


@dataclass
class StepTiming:
    seconds: float  # median seconds per optimizer step
    tokens_per_s: float
    flops_per_s: float
    mfu: float | None
    precision: str


def build_training_step(
    rs: ResolvedSpec, batch_size: int, seq_len: int, precision: str, device: str = "cpu"
):
    """A closure running one optimizer step exactly as the trainer does (autocast, backward,
    a grad scaler for fp16, clipping, optimizer), plus the model. ``precision`` may be
    ``auto``; the step returns the loss (reading it waits for the device)."""
    dev = torch.device(device)
    precision = hardware.choose_precision(precision, dev)
    torch.manual_seed(0)
    model = build_model(rs).to(dev).train()
    opt = rs.optimizer.build(model, rs.optimizer.options)
    scaler = torch.amp.GradScaler(dev.type) if precision == "fp16" else None
    vocab = rs.model.vocab_size
    x = torch.randint(0, vocab, (batch_size, seq_len)).to(dev)
    y = torch.randint(0, vocab, (batch_size, seq_len)).to(dev)

    def step() -> float:
        with hardware.autocast(dev, precision):
            out = model(x, y)
            loss = out.total_loss
        if scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step, model


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
    precision = hardware.choose_precision(precision, dev)
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
