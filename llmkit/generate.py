"""Text generation with the KV cache: temperature, top-k and top-p sampling, or greedy."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from llmkit.model import Transformer


@dataclass
class Sampling:
    max_new_tokens: int = 100
    temperature: float = 1.0  # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    eos_id: int | None = None


def filter_logits(logits: Tensor, top_k: int | None, top_p: float | None) -> Tensor:
    """Mask logits (B, V) outside the top-k and the nucleus of mass top-p."""
    if top_k is not None and 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (keeps at least one)
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


@torch.no_grad()
def generate_ids(model: Transformer, prompt: Tensor, cfg: Sampling) -> Tensor:
    """Continue ``prompt`` (B, T) by up to ``cfg.max_new_tokens`` tokens; returns new ids.

    When the context reaches the model's ``max_seq_len`` the cache is rebuilt from the most
    recent half of the context, so generation can go on as long as asked."""
    was_training = model.training
    model.eval()
    gen = None
    if cfg.seed is not None:
        gen = torch.Generator(device=prompt.device).manual_seed(cfg.seed)
    limit = model.config.max_seq_len
    context = prompt[:, -limit:]
    cache = model.new_cache()
    out: list[Tensor] = []
    try:
        logits = model(context, cache=cache, last_only=True).logits[:, -1]
        done = torch.zeros(prompt.size(0), dtype=torch.bool, device=prompt.device)
        for _ in range(cfg.max_new_tokens):
            if cfg.temperature <= 0:
                nxt = logits.argmax(-1)
            else:
                probs = filter_logits(logits.float() / cfg.temperature, cfg.top_k, cfg.top_p)
                nxt = torch.multinomial(probs.softmax(-1), 1, generator=gen).squeeze(-1)
            out.append(nxt)
            context = torch.cat([context, nxt[:, None]], dim=1)
            if cfg.eos_id is not None:
                done |= nxt == cfg.eos_id
                if bool(done.all()):
                    break
            if cache.position >= limit:
                cache = model.new_cache()
                context = context[:, -(limit // 2) :]
                logits = model(context, cache=cache, last_only=True).logits[:, -1]
            else:
                logits = model(nxt[:, None], cache=cache).logits[:, -1]
    finally:
        model.train(was_training)
    return torch.stack(out, 1) if out else prompt.new_zeros(prompt.size(0), 0)
