"""``branch_budgets``: the shorter ``train.max_steps`` budgets of a WSD sweep as cooldown
branches of its longest run (Hägele et al. 2024; docs/experiments.md).

The schedule says where its stable phase ends and how long it warms up through its options
(the schedule contract's ``stable_end`` and ``warmup``, :mod:`llmkit.optim`)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from llmkit.errors import SpecError
from llmkit.experiments.sweep_axes import Trial, toml_literal
from llmkit.optim import schedule_stable_end, schedule_warmup

if TYPE_CHECKING:
    from llmkit.experiments.sweep import SweepPlan

MAX_STEPS = "train.max_steps"


def plan_branches(plan: SweepPlan, specs: dict[str, Any]) -> dict[str, tuple[str, int]]:
    """``branch_budgets``: group the trials whose overrides differ only in
    ``train.max_steps``; in each group of several budgets (a schedule with a stable phase,
    as WSD), the longest trial gets ``train.checkpoint_steps`` at every shorter budget's
    stable end, and each shorter trial is to be branched from it there. Updates
    ``plan.trials`` and ``specs`` for the longest trials; returns ``{shorter trial id:
    (longest trial id, step)}``. :class:`SpecError` listing every group that cannot be branched."""
    from llmkit.spec import load_spec

    groups: dict[tuple[str, ...], list[Trial]] = {}
    for trial in plan.trials:
        key = tuple(o for o in trial.overrides if o.partition("=")[0].strip() != MAX_STEPS)
        groups.setdefault(key, []).append(trial)
    branches: dict[str, tuple[str, int]] = {}
    problems: list[str] = []
    longest_of: dict[str, list[int]] = {}
    for group in groups.values():
        steps = {t.id: specs[t.id].spec.train.max_steps for t in group}
        longest = max(group, key=lambda t: steps[t.id])
        shorter = [t for t in group if steps[t.id] < steps[longest.id]]
        if not shorter:
            continue
        sched = specs[longest.id].schedule
        own_end = schedule_stable_end(sched.options, steps[longest.id])
        if own_end is None:
            problems.append(
                f"{longest.id}: branch_budgets needs a schedule with a stable phase, "
                f"not {sched.name!r} (budgets {sorted(set(steps.values()))})"
            )
            continue
        warmup = schedule_warmup(sched.options, steps[longest.id])
        for t in shorter:
            at = schedule_stable_end(sched.options, steps[t.id])
            if at is None:
                problems.append(f"{t.id}: its schedule has no stable phase to branch from")
                continue
            if at <= warmup or at > own_end:
                problems.append(
                    f"{t.id}: its decay would start at step {at}, "
                    + (
                        f"within the warmup ({warmup} steps)"
                        if at <= warmup
                        else f"past the stable phase of {longest.id} (ends at step {own_end})"
                    )
                    + "; it cannot be branched"
                )
                continue
            branches[t.id] = (longest.id, at)
            longest_of.setdefault(longest.id, []).append(at)
    if problems:
        where = str(plan.source) if plan.source is not None else f"sweep {plan.name}"
        raise SpecError(problems, f"{where} (branch_budgets; none was run)")
    for i, trial in enumerate(plan.trials):
        if trial.id in longest_of:
            kept = set(specs[trial.id].spec.train.checkpoint_steps) | set(longest_of[trial.id])
            extra = f"train.checkpoint_steps={toml_literal(sorted(kept))}"
            plan.trials[i] = replace(trial, overrides=[*trial.overrides, extra])
            specs[trial.id] = load_spec(plan.base, plan.overrides(plan.trials[i]))
    return branches
