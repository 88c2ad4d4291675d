"""Tensor parallelism on 2 gloo processes: for built-in components in many combinations, a
split model's loss, logits and every gradient (in the model's own row order) equal one
process's (fp32, within 1e-5), mixtures of experts split by expert with their auxiliary
losses; plans are declared by every built-in model component, and a
component without one is refused by name."""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from llmkit.errors import LlmkitError
from llmkit.parallel.tensor import CanonicalOrder, component_plan, grouped_rows

COMBOS: list[dict[str, Any]] = [
    {},  # sdpa, mlp, layernorm, learned positions
    {
        "n_kv_heads": 2,
        "ffn": {"name": "swiglu", "hidden": 96},
        "norm": {"name": "rmsnorm"},
        "position": {"name": "rope"},
        "tie_embeddings": True,
    },
    {
        "n_kv_heads": 2,
        "position": {"name": "alibi"},
        "attention": {"name": "dense"},
        "ffn": {"name": "geglu", "hidden": 64},
        "qk_transform": {"name": "rmsnorm"},
    },
    {"block": {"name": "parallel"}, "qkv_bias": True, "attention": {"name": "flash"}},
    {"block": {"name": "sandwich"}, "attention": {"name": "sliding_window", "window": 4}},
    {"n_kv_heads": 1, "position": {"name": "rope"}, "qkv_bias": True},  # MQA: kv head copied
    {"n_heads": 2, "n_kv_heads": 1, "position": {"name": "alibi"}},  # one q head a rank
    {  # expert parallelism: 4 experts, 2 a rank; shared gated expert, capacity, biases
        "ffn": {
            "name": "moe",
            "num_experts": 4,
            "top_k": 2,
            "expert": {"name": "swiglu", "hidden": 32},
            "shared_experts": 1,
            "shared_expert_gate": True,
            "capacity_factor": 1.0,
            "router_bias": True,
            "load_balance_coef": 0.01,
            "z_loss_coef": 0.001,
        },
        "bias": True,
    },
    {  # DeepSeek-V3 routing, plain mlp experts
        "ffn": {
            "name": "moe",
            "num_experts": 4,
            "top_k": 2,
            "routing": "sigmoid_topk",
            "n_group": 2,
            "topk_group": 1,
            "expert": {"name": "mlp", "hidden": 32},
        },
    },
]


def _worker(rank: int, world: int, store: str, path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from llmkit.model import build_model
    from llmkit.parallel.tensor import parallelize_transformer
    from llmkit.spec import load_spec_dict
    from tests.helpers import tiny_spec

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    results = []
    for i, kw in enumerate(COMBOS):
        torch.manual_seed(i)
        model = build_model(load_spec_dict(tiny_spec(**kw)))
        ref = copy.deepcopy(model)
        order = parallelize_transformer(model, mesh)
        x = torch.randint(0, 64, (2, 16))
        y = torch.randint(0, 64, (2, 16))
        y[0, :3] = -100
        out = model(x, y)
        sum(out.aux_losses.values(), out.loss).backward()  # auxiliary losses (moe) included
        expected = ref(x, y)
        sum(expected.aux_losses.values(), expected.loss).backward()
        grads = {}
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = (order.to_canonical(name, g) - q.grad).abs().max().item()
        model.eval()
        ref.eval()
        with torch.no_grad():
            logits = (model(x).logits - ref(x).logits).abs().max().item()
        aux = sum(abs(out.aux_losses[k].item() - v.item()) for k, v in expected.aux_losses.items())
        results.append((out.loss.item(), expected.loss.item(), grads, logits, aux))
    if rank == 0:
        torch.save(results, path)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def split_results(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    tmp = tmp_path_factory.mktemp("tp")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(
        _worker,
        args=(2, str(tmp / "store"), str(tmp / "out.pt")),
        nprocs=2,
        start_method="spawn",
    )
    return torch.load(tmp / "out.pt", weights_only=False)


@pytest.mark.parametrize("i", range(len(COMBOS)))
def test_a_split_model_computes_what_one_process_computes(split_results, i):
    loss, expected, grads, logits, aux = split_results[i]
    assert abs(loss - expected) <= 1e-5 and aux <= 1e-6
    worst = max(grads, key=grads.get)
    assert grads[worst] <= 1e-5, (worst, grads[worst])
    assert logits <= 1e-5


def test_grouped_rows_put_each_kv_group_together_and_canonical_order_inverts_them():
    # 4 query heads, 2 kv heads, head size 1: rows q0 q1 q2 q3 k0 k1 v0 v1
    rows = grouped_rows(4, 2, 1).tolist()
    assert rows == [0, 1, 4, 6, 2, 3, 5, 7]
    order = CanonicalOrder()
    order.add("w", torch.tensor(rows))
    w = torch.arange(8.0)[:, None].repeat(1, 3)
    assert torch.equal(order.to_canonical("w", order.to_model("w", w)), w)
    assert order.to_model("other", w) is w  # names not reordered pass through


def test_every_built_in_model_component_declares_a_plan():
    from torch.distributed.tensor.parallel.style import ParallelStyle

    from llmkit.model import build_model
    from llmkit.spec import load_spec_dict
    from tests.helpers import tiny_spec

    for kw in COMBOS:
        model = build_model(load_spec_dict(tiny_spec(**kw)))
        parts = [model.position, *model.ffn_modules, *model.layers]
        parts += [a.kernel for a in model.attention_modules]
        parts += [n for norms in model.norm_modules for n in norms]
        for part in parts:
            plan = component_plan(part, type(part).__name__, 2)
            assert all(isinstance(s, ParallelStyle) for s in plan.values()), part


def test_a_component_without_a_plan_is_refused_by_name():
    class PluginFFN(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(
        LlmkitError, match=r"ffn 'mine' \(.*PluginFFN\) declares no tensor-parallel"
    ):
        component_plan(PluginFFN(), "ffn 'mine'", 2)


def test_a_hidden_size_tp_does_not_divide_is_one_line():
    from llmkit.model import build_model
    from llmkit.spec import load_spec_dict
    from tests.helpers import tiny_spec

    model = build_model(load_spec_dict(tiny_spec(ffn={"name": "swiglu"})))  # hidden 85
    with pytest.raises(LlmkitError, match="hidden size = 85 is not a multiple of"):
        component_plan(model.ffn_modules[0], "ffn", 2)


def test_moe_splits_whole_experts_only():
    from llmkit.model import build_model
    from llmkit.spec import load_spec_dict
    from tests.helpers import tiny_spec

    model = build_model(load_spec_dict(tiny_spec(ffn={"name": "moe", "num_experts": 6})))
    assert set(component_plan(model.ffn_modules[0], "ffn 'moe'", 2)) == {""}
    with pytest.raises(LlmkitError, match="num_experts = 6 is not a multiple of"):
        component_plan(model.ffn_modules[0], "ffn 'moe'", 4)


def test_the_conformance_check_refuses_a_malformed_plan():
    from types import SimpleNamespace

    from llmkit.parallel.tensor import column
    from llmkit.testing.parallel_plan import check_parallel_plan

    record = SimpleNamespace(kind="ffn", name="mine", distribution="plugin")

    class Named(nn.Module):
        def __init__(self, plan):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self._plan = plan

        def tensor_parallel_plan(self, tp):
            return self._plan

    check_parallel_plan(record, Named({"proj": column()}))  # well formed
    with pytest.raises(AssertionError, match="names 'missing', which is not"):
        check_parallel_plan(record, Named({"missing": column()}))
    with pytest.raises(AssertionError, match="not a ParallelStyle"):
        check_parallel_plan(record, Named({"proj": "colwise"}))
    with pytest.raises(AssertionError, match="not a dict"):
        check_parallel_plan(record, Named([]))
