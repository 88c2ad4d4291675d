"""Pipeline parallelism (llmkit.parallel.pipeline): the layer cut, stage modules, and torch's
schedules over them.

One spawn of 2 gloo CPU processes (module-scoped) trains every case for 3 SGD steps through
:class:`Pipeline` (gpipe and 1f1b on pp = 2; interleaved 1F1B with 2 ranks × 2 stages; and
interleaved 1F1B with 2 stages on one rank, tied embeddings allowed there), with a
``forward`` / ``evaluate`` between steps, and saves losses, logits and final parameters by
name; the tests compare them with one process training the whole Transformer on the same
batches.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from llmkit.errors import LlmkitError
from llmkit.model import build_model
from llmkit.model.transformer import Transformer
from llmkit.parallel.pipeline import (
    Pipeline,
    PipelineStageModule,
    build_stages,
    layer_costs,
    split_layers,
    stage_ranges,
)
from llmkit.spec import load_spec_dict
from tests.helpers import init_gloo, spawn_workers, tiny_spec

WORLD = 2
STEPS = 3
EVAL_AFTER = 1  # forward() and evaluate() run after this many steps


@dataclass(frozen=True)
class Case:
    name: str
    schedule: str
    n_microbatches: int
    pp: int = 2
    per_rank: int = 1
    position: str = "rope"
    tied: bool = False
    checkpointing: bool = False


CASES = [
    Case("gpipe", "gpipe", 2),
    Case("1f1b", "1f1b", 4, checkpointing=True),
    Case("interleaved", "interleaved_1f1b", 4, per_rank=2),
    # pp = 1 (a group of one rank) holding 2 stages: tied embeddings are allowed there
    Case("one_rank_tied", "interleaved_1f1b", 2, pp=1, per_rank=2, position="learned", tied=True),
]


def make_model(case: Case) -> Transformer:
    spec = tiny_spec(
        n_layers=4,
        max_seq_len=16,
        dropout=0.0,
        position={"name": case.position},
        tie_embeddings=case.tied,
    )
    torch.manual_seed(0)
    model = build_model(load_spec_dict(spec))
    model.activation_checkpointing = case.checkpointing
    return model


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g))
        for _ in range(STEPS)
    ]


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def reference(case: Case) -> dict:
    """One process training the whole model on the same batches."""
    model = make_model(case).train()
    opt = optimizer(model.parameters())
    losses, logits, eval_loss = [], None, None
    for i, (x, y) in enumerate(batches()):
        if i == EVAL_AFTER:
            with torch.no_grad():
                out = model(x, y)
            logits, eval_loss = out.logits, out.loss
        opt.zero_grad()
        loss = model(x, y).loss
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    params = {n: p.detach() for n, p in model.named_parameters()}
    return {"losses": torch.stack(losses), "params": params, "logits": logits, "eval": eval_loss}


def _run_case(case: Case, rank: int, group, tmp: Path) -> None:
    model = make_model(case)
    pp_rank = rank if case.pp > 1 else 0
    stages = build_stages(
        model,
        pp_rank=pp_rank,
        pp_size=case.pp,
        stages_per_rank=case.per_rank,
        device="cpu",
        group=group,
    )
    pipe = Pipeline(stages, case.schedule, case.n_microbatches).train()
    opt = optimizer(pipe.parameters())
    losses, logits, eval_loss = [], None, None
    for i, (x, y) in enumerate(batches()):
        if i == EVAL_AFTER:
            logits = pipe.forward(x)
            eval_loss = pipe.evaluate(x, y)
        opt.zero_grad()
        losses.append(pipe.step(x, y))
        opt.step()
    result = {
        "stages": [s.stage_index for s in stages],
        "layers": [m.layer_ids for m in pipe.modules],
        "is_first": pipe.is_first,
        "is_last": pipe.is_last,
        "losses": losses,
        "logits": logits,
        "eval": eval_loss,
        "params": {n: p.detach() for n, p in pipe.named_parameters()},
        "meta": sorted(n for n, p in model.named_parameters() if p.is_meta),
    }
    torch.save(result, tmp / f"{case.name}-{rank}.pt")


def _worker(rank: int, world: int, tmp: str) -> None:
    init_gloo(rank, world, tmp)
    try:
        alone = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
        for case in CASES:
            if case.pp > 1:
                _run_case(case, rank, None, Path(tmp))
            elif rank == 0:
                _run_case(case, rank, alone[rank], Path(tmp))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory of the 2-process run's results (run once; fails, never hangs)."""
    tmp = tmp_path_factory.mktemp("pp")
    spawn_workers(_worker, (WORLD, str(tmp)), WORLD, "pipeline")
    return tmp


def results(ran: Path, case: Case) -> list[dict]:
    ranks = range(WORLD) if case.pp > 1 else [0]
    return [torch.load(ran / f"{case.name}-{r}.pt") for r in ranks]


# -- the cut -----------------------------------------------------------------------------------
def _brute_force(costs: list[float], stages: int, first: float, last: float) -> float:
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        loads = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
        loads[0] += first
        loads[-1] += last
        best = min(best, max(loads))
    return best


def test_split_layers_balances_and_is_contiguous():
    assert split_layers([1.0] * 4, 2) == [range(0, 2), range(2, 4)]
    assert split_layers([1.0] * 4, 1) == [range(0, 4)]
    assert split_layers([1, 1, 1, 1, 1, 5], 2) == [range(0, 5), range(5, 6)]  # a heavy layer
    assert split_layers([5, 1, 1, 1, 1, 1], 3) == [range(0, 1), range(1, 3), range(3, 6)]
    # the embedding and the head count on the first and the last stage
    assert split_layers([1.0] * 6, 2, first=2.0) == [range(0, 2), range(2, 6)]
    assert split_layers([1.0] * 6, 2, last=4.0) == [range(0, 5), range(5, 6)]
    # every stage holds a layer, even at zero cost
    assert split_layers([0.0] * 5, 5) == [range(j, j + 1) for j in range(5)]
    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(1, 8)
        costs = [float(rng.randint(0, 9)) for _ in range(n)]
        stages = rng.randint(1, n)
        first, last = float(rng.randint(0, 9)), float(rng.randint(0, 9))
        ranges = split_layers(costs, stages, first=first, last=last)
        assert len(ranges) == stages and all(len(r) > 0 for r in ranges)
        assert [j for r in ranges for j in r] == list(range(n))
        loads = [sum(costs[j] for j in r) for r in ranges]
        loads[0] += first
        loads[-1] += last
        assert max(loads) == _brute_force(costs, stages, first, last)
        assert split_layers(costs, stages, first=first, last=last) == ranges  # deterministic


def test_split_layers_refuses_more_stages_than_layers():
    with pytest.raises(LlmkitError, match="cannot cut 4 layers into 5 stages"):
        split_layers([1.0] * 4, 5)
    with pytest.raises(LlmkitError, match="cannot cut 4 layers into 0 stages"):
        split_layers([1.0] * 4, 0)
    with pytest.raises(LlmkitError, match="non-negative"):
        split_layers([1.0, -1.0], 2)


def test_stage_ranges_count_parameters_of_each_layer():
    spec = tiny_spec(
        n_layers=4,
        tie_embeddings=False,
        overrides=[{"layers": [1], "ffn": {"name": "moe", "num_experts": 8}}],
    )
    model = build_model(load_spec_dict(spec))
    costs, first, last = layer_costs(model)
    assert costs[1] > 2 * costs[0] and costs[0] == costs[2] == costs[3]
    assert first == model.tok_emb.weight.numel() + sum(
        p.numel() for p in model.position.parameters()
    )
    assert last == sum(p.numel() for p in (*model.norm_f.parameters(), *model.lm_head.parameters()))
    ranges = stage_ranges(model, 2)
    assert ranges == split_layers(costs, 2, first=first, last=last)
    assert ranges == [range(0, 2), range(2, 4)]  # the MoE layer outweighs two dense ones


# -- stage modules in one process --------------------------------------------------------------
def test_stage_modules_use_the_models_names_and_compute_its_logits():
    case = Case("local", "gpipe", 1, checkpointing=True)
    model = make_model(case)
    ranges = [range(0, 1), range(1, 3), range(3, 4)]
    parts = [
        PipelineStageModule(model, r, is_first=s == 0, is_last=s == 2) for s, r in enumerate(ranges)
    ]
    names = [dict(p.named_parameters()) for p in parts]
    model_params = dict(model.named_parameters())
    assert set().union(*names) == set(model_params)
    assert sum(len(n) for n in names) == len(model_params)  # each parameter on one stage
    assert "tok_emb.weight" in names[0] and "layers.0.attn.qkv.weight" in names[0]
    assert "layers.2.attn.qkv.weight" in names[1] and "lm_head.weight" in names[2]
    for n in names:
        for name, p in n.items():
            assert p is model_params[name]
    assert "norm_f.weight" in names[2] and parts[1].position is model.position  # rope
    x = torch.randint(0, 64, (2, 16))
    h = x
    for part in parts:
        h = part(h)
    torch.testing.assert_close(h, model(x).logits, atol=0, rtol=0)
    # with activation checkpointing, training: the same logits and gradients
    model.train()
    loss = torch.nn.functional.cross_entropy(
        parts[2](parts[1](parts[0](x))).flatten(0, 1), x.flatten()
    )
    grads = torch.autograd.grad(loss, list(model_params.values()))
    model.activation_checkpointing = False
    ref = model(x, x).loss
    torch.testing.assert_close(loss, ref)
    for g, r in zip(grads, torch.autograd.grad(ref, list(model_params.values())), strict=True):
        torch.testing.assert_close(g, r)


def test_tied_embeddings_across_ranks_are_refused():
    model = make_model(Case("tied", "gpipe", 1, tied=True))
    with pytest.raises(LlmkitError, match=r"cannot tie the embedding.*tie_embeddings = false"):
        build_stages(model, pp_rank=0, pp_size=2)
    assert not any(p.is_meta for p in model.parameters())  # refused before touching the model


def test_unknown_schedule_and_stage_count_are_refused():
    with pytest.raises(LlmkitError, match="unknown schedule 'zb'"):
        Pipeline([object()], "zb", 2)
    with pytest.raises(LlmkitError, match="runs one stage per rank"):
        Pipeline([object(), object()], "1f1b", 2)


# -- the 2-process runs ------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_training_matches_one_process(ran, case):
    ref = reference(case)
    runs = results(ran, case)
    held = sorted(s for r in runs for s in r["stages"])
    assert held == list(range(case.pp * case.per_rank))
    if case.pp > 1:  # loop-style placement: rank r holds stages r, r + pp, ...
        for rank, r in enumerate(runs):
            assert r["stages"] == list(range(rank, case.pp * case.per_rank, case.pp))
    last = [r for r in runs if r["is_last"]]
    assert len(last) == 1
    assert all(loss is None for r in runs if not r["is_last"] for loss in r["losses"])
    torch.testing.assert_close(torch.stack(last[0]["losses"]), ref["losses"], atol=1e-5, rtol=0)
    params: dict[str, torch.Tensor] = {}
    for r in runs:
        assert not set(params) & set(r["params"])  # every parameter on one rank
        params |= r["params"]
    assert set(params) == set(ref["params"])
    for name, value in params.items():
        torch.testing.assert_close(value, ref["params"][name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_forward_and_evaluate_match_the_model(ran, case):
    ref = reference(case)
    for r in results(ran, case):
        if r["is_last"]:
            torch.testing.assert_close(r["logits"], ref["logits"], atol=1e-5, rtol=0)
            torch.testing.assert_close(r["eval"], ref["eval"], atol=1e-5, rtol=0)
        else:
            assert r["logits"] is None and r["eval"] is None


def test_parts_not_held_are_freed(ran):
    runs = results(ran, CASES[0])  # gpipe: rank 0 holds layers 0-1 and the embedding
    assert runs[0]["layers"] == [[0, 1]] and runs[1]["layers"] == [[2, 3]]
    assert "lm_head.weight" in runs[0]["meta"] and "layers.2.attn.qkv.weight" in runs[0]["meta"]
    assert "tok_emb.weight" in runs[1]["meta"] and "layers.0.attn.qkv.weight" in runs[1]["meta"]
    assert not set(runs[0]["meta"]) & set(runs[0]["params"])
