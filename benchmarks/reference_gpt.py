"""A plain-PyTorch baseline for our trainer: the GPT and the training loop nanoGPT documents,
written here from its published description, so llmkit can be measured side by side with
"a small trainer in plain PyTorch" on the same machine.

nanoGPT's own ``train.py`` cannot be fetched on our machines; what it does is documented
(Karpathy, nanoGPT README and ``config/train_shakespeare_char.py``), and this module
follows that description:

- model: token + learned position embeddings, pre-LayerNorm blocks (no biases), causal
  attention through ``F.scaled_dot_product_attention``, a 4× GELU MLP, a final LayerNorm, and
  an output head tied to the token embedding; weights N(0, 0.02), the two residual output
  projections N(0, 0.02/√(2·layers));
- optimizer: AdamW with weight decay on every matrix (embeddings included), none on
  vectors; warmup ``lr·(it+1)/(warmup+1)`` then cosine to ``min_lr``; gradient clipping 1.0;
- data: characters of the corpus (vocabulary = its sorted distinct characters), first 90 %
  for training and the last 10 % for validation, batches at uniformly random offsets;
- evaluation every ``eval_interval`` steps: the mean loss over ``eval_iters`` random batches
  of each split. fp32 on CPU (nanoGPT autocasts only on CUDA), no ``torch.compile``.

On a GPU (``--device cuda``) it runs as nanoGPT's ``train.py`` does there: ``--dtype
bfloat16`` autocasts the forward (the default on CUDA), TF32 matmuls are allowed, AdamW is
the fused one, batches go through pinned memory, and ``--compile`` wraps the training forward
in ``torch.compile`` (evaluation runs the plain module, so it compiles nothing).

``python -m benchmarks.reference_gpt --data PATH`` runs the shakespeare-char CPU recipe
and prints one JSON line (final validation loss, wall time, tokens/s, every step's time);
``--log-interval N`` also prints nanoGPT's ``iter N: loss X, time Y ms`` line every N steps.
The shape options (``--n-layer`` …) change the model; ``benchmarks/scripts/gpu_train_compare.py``
runs it at GPT-2 small's shape on CUDA. ``benchmarks/training/test_training.py`` times its
training step next to ours.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class Recipe:
    """nanoGPT's shakespeare-char CPU run (its README) unless overridden."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    batch_size: int = 12
    max_iters: int = 2000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 100
    lr_decay_iters: int = 2000
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    dropout: float = 0.0
    eval_interval: int = 250
    eval_iters: int = 20
    seed: int = 1337


#: nanoGPT's "baby GPT" shape at batch 16, the issue's throughput comparison.
BABY_GPT = dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=16, dropout=0.2)


class Block(nn.Module):
    def __init__(self, r: Recipe) -> None:
        super().__init__()
        d = r.n_embd
        self.n_head, self.dropout = r.n_head, r.dropout
        self.ln1 = nn.LayerNorm(d, bias=False)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.attn_out = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d, bias=False)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.mlp_out = nn.Linear(4 * d, d, bias=False)
        self.drop = nn.Dropout(r.dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + self.drop(self.attn_out(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp_out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, r: Recipe, vocab_size: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, r.n_embd)
        self.pos = nn.Embedding(r.block_size, r.n_embd)
        self.drop = nn.Dropout(r.dropout)
        self.blocks = nn.ModuleList(Block(r) for _ in range(r.n_layer))
        self.ln_f = nn.LayerNorm(r.n_embd, bias=False)
        self.head = nn.Linear(r.n_embd, vocab_size, bias=False)
        self.head.weight = self.tok.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
        for blk in self.blocks:
            for w in (blk.attn_out.weight, blk.mlp_out.weight):
                nn.init.normal_(w, 0.0, 0.02 / math.sqrt(2 * r.n_layer))

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    def flops_per_token(self, seq_len: int, r: Recipe) -> float:
        """Training FLOPs per token as llmkit counts them (PaLM appendix B): 6·(parameters
        without the position embedding) + 12·layers·seq·width for the attention."""
        n = sum(p.numel() for p in self.parameters()) - self.pos.weight.numel()
        return 6 * n + 12 * r.n_layer * seq_len * r.n_embd


def optimizer(model: GPT, r: Recipe, fused: bool = False) -> torch.optim.AdamW:
    """AdamW as nanoGPT configures it; ``fused`` (its choice on CUDA) takes the fused kernel."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": r.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    extra = {"fused": True} if fused else {}
    return torch.optim.AdamW(groups, lr=r.lr, betas=(r.beta1, r.beta2), **extra)


def lr_at(it: int, r: Recipe) -> float:
    if it < r.warmup_iters:
        return r.lr * (it + 1) / (r.warmup_iters + 1)
    if it > r.lr_decay_iters:
        return r.min_lr
    ratio = (it - r.warmup_iters) / (r.lr_decay_iters - r.warmup_iters)
    return r.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (r.lr - r.min_lr)


def char_splits(text: str) -> tuple[Tensor, Tensor, int]:
    """(train ids, validation ids, vocabulary size): first 90 % / last 10 % of the text."""
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)
    cut = int(0.9 * len(ids))
    return ids[:cut], ids[cut:], len(chars)


def batch(data: Tensor, r: Recipe, device: str = "cpu") -> tuple[Tensor, Tensor]:
    ix = torch.randint(len(data) - r.block_size, (r.batch_size,))
    x = torch.stack([data[i : i + r.block_size] for i in ix.tolist()])
    y = torch.stack([data[i + 1 : i + 1 + r.block_size] for i in ix.tolist()])
    if device.startswith("cuda"):  # as nanoGPT: pinned, asynchronous copies
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(
            device, non_blocking=True
        )
    return x, y


def autocast(device: str, dtype: str) -> contextlib.AbstractContextManager[Any]:
    """The forward's precision: fp32 plainly, else autocast to ``dtype`` (nanoGPT's ``ctx``)."""
    if dtype == "float32":
        return contextlib.nullcontext()
    kind = "cuda" if device.startswith("cuda") else device
    return torch.autocast(device_type=kind, dtype=getattr(torch, dtype))


def train_step(
    model: Callable[[Tensor, Tensor], Tensor],
    opt: torch.optim.Optimizer,
    x: Tensor,
    y: Tensor,
    r: Recipe,
    precision: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> float:
    """One optimizer step; ``model`` may be the module or its compiled forward. The loss read
    back at the end synchronises with the device, so the step's time is all in."""
    with precision():
        loss = model(x, y)
    loss.backward()
    if r.grad_clip:
        params = [p for group in opt.param_groups for p in group["params"]]
        nn.utils.clip_grad_norm_(params, r.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


@torch.no_grad()
def estimate(
    model: GPT,
    data: Tensor,
    r: Recipe,
    device: str = "cpu",
    precision: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> float:
    model.eval()
    losses = []
    for _ in range(r.eval_iters):
        with precision():
            losses.append(float(model(*batch(data, r, device))))
    model.train()
    return statistics.fmean(losses)


@torch.no_grad()
def full_split_loss(
    model: GPT,
    data: Tensor,
    r: Recipe,
    device: str = "cpu",
    precision: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> float:
    """Mean loss over every non-overlapping block of the split (as ``llmkit eval`` reads a
    held-out split), weighted by tokens."""
    model.eval()
    n = (len(data) - 1) // r.block_size
    x = data[: n * r.block_size].view(n, r.block_size)
    y = data[1 : n * r.block_size + 1].view(n, r.block_size)
    total = 0.0
    for xb, yb in zip(x.split(64), y.split(64)):
        with precision():
            total += float(model(xb.to(device), yb.to(device))) * len(xb)
    model.train()
    return total / n


def run(
    text: str,
    r: Recipe,
    full_split: bool = True,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    compile: bool = False,
    log_interval: int = 0,
    log: Callable[[str], None] = print,
) -> dict:
    """Train with the recipe; evaluations, the last validation loss (and the loss over the
    whole validation split unless ``full_split`` is false) and the timings. ``device``,
    ``dtype`` (the forward's autocast; float32 = none) and ``compile`` as in the module
    docstring; ``log_interval`` > 0 logs nanoGPT's ``iter`` line every that many steps."""
    t_start = time.perf_counter()
    torch.manual_seed(r.seed)
    cuda = device.startswith("cuda")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True  # as nanoGPT's train.py
        torch.backends.cudnn.allow_tf32 = True
    train, val, vocab = char_splits(text)
    model = GPT(r, vocab).to(device)
    opt = optimizer(model, r, fused=cuda)
    forward = torch.compile(model) if compile else model

    def precision() -> contextlib.AbstractContextManager[Any]:
        return autocast(device, dtype)

    evals, step_times = [], []
    for it in range(r.max_iters + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(it, r)
        if it % r.eval_interval == 0 or it == r.max_iters:
            train_loss = estimate(model, train, r, device, precision)
            evals.append({"step": it, "train": train_loss,
                          "val": estimate(model, val, r, device, precision)})  # fmt: skip
        if it == r.max_iters:
            break
        t0 = time.perf_counter()
        loss = train_step(forward, opt, *batch(train, r, device), r, precision)
        step_times.append(time.perf_counter() - t0)
        if log_interval and it % log_interval == 0:
            log(f"iter {it}: loss {loss:.4f}, time {step_times[-1] * 1000:.2f}ms")
    med = statistics.median(step_times[5:] or step_times)
    return {
        "recipe": asdict(r),
        "device": device,
        "dtype": dtype,
        "compile": compile,
        "evals": evals,
        "val_loss": evals[-1]["val"],
        "wall_s": time.perf_counter() - t_start,
        "full_val_loss": full_split_loss(model, val, r, device, precision) if full_split else None,
        "train_s": sum(step_times),
        "tokens_per_s": r.batch_size * r.block_size / med,
        "step_ms": [round(t * 1e3, 3) for t in step_times],
        "flops_per_token": model.flops_per_token(r.block_size, r),
        "threads": torch.get_num_threads(),
    }


def build_step(r: Recipe, vocab_size: int = 65):
    """A closure doing one optimizer step on fixed random tokens, and the model (for the
    side-by-side throughput benchmark)."""
    torch.manual_seed(0)
    model = GPT(r, vocab_size).train()
    opt = optimizer(model, r)
    x = torch.randint(0, vocab_size, (r.batch_size, r.block_size))
    y = torch.randint(0, vocab_size, (r.batch_size, r.block_size))
    return (lambda: train_step(model, opt, x, y, r)), model


@torch.no_grad()
def load_llmkit_weights(model: GPT, llmkit_model: nn.Module) -> None:
    """Copy the weights of an llmkit model of the same GPT shape (learned positions,
    LayerNorm without bias, fused qkv, GELU MLP, tied head) into ``model``."""
    sd = llmkit_model.state_dict()
    model.tok.weight.copy_(sd["tok_emb.weight"])
    model.pos.weight.copy_(sd["position.wpe.weight"])
    model.ln_f.weight.copy_(sd["norm_f.weight"])
    names = {
        "ln1": "norm1",
        "ln2": "norm2",
        "qkv": "attn.qkv",
        "attn_out": "attn.out_proj",
        "fc": "ffn.in_proj",
        "mlp_out": "ffn.out_proj",
    }
    for i, blk in enumerate(model.blocks):
        for ours, theirs in names.items():
            getattr(blk, ours).weight.copy_(sd[f"layers.{i}.{theirs}.weight"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=Path("../shared/data/tinyshakespeare.txt"))
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--max-iters", type=int, default=2000)
    ap.add_argument("--eval-iters", type=int, default=20, help="batches per estimate")
    ap.add_argument("--no-full-split", action="store_true", help="skip the full-split loss")
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    ap.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="the forward's autocast dtype; auto: bfloat16 on CUDA, float32 elsewhere",
    )
    ap.add_argument("--compile", action="store_true", help="torch.compile the training forward")
    ap.add_argument("--log-interval", type=int, default=0, help="print an iter line every N")
    defaults = Recipe()
    for flag in ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "eval_interval"):
        ap.add_argument(f"--{flag.replace('_', '-')}", type=int, default=getattr(defaults, flag))
    ap.add_argument("--dropout", type=float, default=defaults.dropout)
    args = ap.parse_args(argv)
    r = Recipe(
        seed=args.seed,
        max_iters=args.max_iters,
        lr_decay_iters=args.max_iters,
        eval_iters=args.eval_iters,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        block_size=args.block_size,
        batch_size=args.batch_size,
        eval_interval=args.eval_interval,
        dropout=args.dropout,
    )
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    text = args.data.read_text(encoding="utf-8")
    result = run(
        text,
        r,
        full_split=not args.no_full_split,
        device=args.device,
        dtype=dtype,
        compile=args.compile,
        log_interval=args.log_interval,
        log=lambda line: print(line, flush=True),
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
