"""LoRA fine-tuning on the device: three steps on top of the shared ``sdpa`` run, with
``flash`` attention (the Triton kernel reading the adapted q/k/v projection), in bf16.

After the run: the loss and gradient norm of each step are finite (the gradient norm, that of
the trainable parameters, positive); the trainable parameters are exactly the adapters' A and
B; every adapter's B, which starts at zero, has moved, so gradients reached every adapted
layer; and every base weight equals the base run's bit for bit (frozen). Exact comparisons:
nothing rounds a frozen weight.
"""

from __future__ import annotations

import math

import torch

from llmkit.runs import load_run
from llmkit.training import train
from tests.gpu.common import quiet, step_lines, write_spec

ADAPTER = {
    "name": "lora",
    "rank": 4,
    "alpha": 8.0,
    "targets": ["attn.qkv", "attn.out_proj", "ffn.*"],
}
ADAPTED = ".parametrizations.weight."


def test_a_lora_run_trains_only_its_adapters(runs, tmp_path):
    base = runs("sdpa").dir
    spec = write_spec(
        tmp_path,
        {"name": "flash"},
        model={"adapter": ADAPTER},
        schedule={"name": "constant"},
        max_steps=3,
        eval_interval=3,
        init_from=str(base),
    )
    result = train(spec, run_dir=tmp_path / "run", **quiet())
    assert result.step == 3
    lines = step_lines(tmp_path / "run")
    assert len(lines) == 3
    for m in lines:
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0

    model = result.model
    params = dict(model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert trainable and all(f"{ADAPTED}0." in n for n in trainable), sorted(trainable)
    adapters = {n.rsplit(".", 1)[0] for n in trainable}
    assert len(adapters) == 2 * 4  # 2 layers × (qkv, out_proj, ffn in, ffn out)
    for prefix in sorted(adapters):
        assert params[f"{prefix}.B"].detach().abs().sum() > 0, f"{prefix}.B never moved"

    state = model.state_dict()
    for name, value in load_run(base).model.state_dict().items():
        key = name.replace(".weight", f"{ADAPTED}original") if name not in state else name
        assert torch.equal(state[key].cpu(), value), name
