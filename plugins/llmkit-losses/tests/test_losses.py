"""The ``loss`` kind: declared through register_kinds, checked by llmkit's conformance suite
(with the check the kind declares), and usable from Python."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from llmkit_losses import build_loss
from llmkit_losses.base import Loss, LossOptions, flatten, masked_mean
from llmkit_losses.conformance import check_loss

from llmkit import LlmkitError, Registry, load_spec_dict, reset_registry
from llmkit import cli_main as main
from llmkit.testing import check_component, check_generic, conformance_params

PROVIDER = "llmkit-losses"


def losses_registry() -> Registry:
    reg = Registry()
    reg.load_entry_points(["losses"])
    info = reg.plugins.get("losses")
    assert info is not None, "llmkit-losses is not installed: pip install -e plugins/llmkit-losses"
    assert info.error is None, info.error
    return reg


REGISTRY = losses_registry()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is faster and steadier
    yield
    torch.set_num_threads(threads)


def test_the_kind_is_declared_with_its_contract_and_check():
    kind = REGISTRY.kinds["loss"]
    assert kind.provider == PROVIDER and kind.contract == "llmkit_losses.base:Loss"
    assert kind.check == "llmkit_losses.conformance:check_loss"
    assert kind.load_check() is check_loss
    assert [c.name for c in REGISTRY.list("loss")] == ["cross_entropy", "label_smoothing", "z_loss"]


@pytest.mark.parametrize("record", conformance_params("loss", registry=REGISTRY))
def test_component_conforms(record):
    check_component(record, registry=REGISTRY)


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("label_smoothing", {"smoothing": 0.5}),
        ("z_loss", {"weight": 0.1}),
        ("cross_entropy", {"ignore_index": 0}),
    ],
)
def test_variant_conforms(name, options):
    check_component(REGISTRY.get("loss", name), options, registry=REGISTRY)


# -- the check has teeth ------------------------------------------------------------------------


class SumLoss(Loss):
    def forward(self, logits, targets):
        flat, tgt, keep = flatten(logits, targets, self.options.ignore_index)
        return F.cross_entropy(flat, tgt.masked_fill(~keep, 0), reduction="none")[keep].sum()


class NoIgnoreLoss(Loss):
    def forward(self, logits, targets):
        flat, tgt, _ = flatten(logits, targets, self.options.ignore_index)
        return F.cross_entropy(flat, tgt.clamp(min=0))


class NanWhenEmptyLoss(Loss):
    def forward(self, logits, targets):
        flat, tgt, _ = flatten(logits, targets, self.options.ignore_index)
        return F.cross_entropy(flat, tgt, ignore_index=self.options.ignore_index)


class RewardLoss(Loss):
    """Maximizes the likelihood: the wrong sign."""

    def forward(self, logits, targets):
        flat, tgt, keep = flatten(logits, targets, self.options.ignore_index)
        nll = F.cross_entropy(flat, tgt.masked_fill(~keep, 0), reduction="none")
        return -masked_mean(nll, keep)


class HalfPrecisionLoss(Loss):
    def forward(self, logits, targets):
        flat, tgt, keep = flatten(logits, targets, self.options.ignore_index)
        nll = F.cross_entropy(flat, tgt.masked_fill(~keep, 0), reduction="none")
        return masked_mean(nll, keep).to(logits.dtype)


def _fake(target) -> tuple[Registry, Any]:
    """A registry with llmkit-losses and ``target`` registered as ``loss.fake``, and its record."""
    from llmkit import hookimpl

    class Plugin:
        @hookimpl
        def register_components(self, register):
            register("loss", "fake", target, options=LossOptions)

    reg = losses_registry()
    reg.add_plugin(Plugin(), "fake", "llmkit-fake", "0")
    return reg, reg.get("loss", "fake")


@pytest.mark.parametrize(
    ("target", "match"),
    [
        (SumLoss, "a mean over targets"),
        (NoIgnoreLoss, "ignore_index must leave"),
        (NanWhenEmptyLoss, "every target ignored"),
        (RewardLoss, "not a training objective"),
        (HalfPrecisionLoss, "dtype torch.bfloat16"),
    ],
    ids=lambda x: x.__name__ if isinstance(x, type) else None,
)
def test_broken_losses_fail_the_check(target, match):
    reg, record = _fake(target)
    with pytest.raises(AssertionError, match=match):
        check_loss(record)
    check_generic(record)  # what a kind without a check of its own would get: passes
    with pytest.raises(AssertionError, match=match):  # check_component runs the kind's check
        check_component(record, registry=reg)


# -- the math -----------------------------------------------------------------------------------


def _data(ignore=True):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 13, generator=g) * 3
    targets = torch.randint(0, 13, (3, 7), generator=g)
    if ignore:
        targets[1, :4] = -100
    return logits, targets


def test_cross_entropy_is_torch_cross_entropy():
    logits, targets = _data()
    got = build_loss("cross_entropy", REGISTRY)(logits, targets)
    assert torch.allclose(got, F.cross_entropy(logits.view(-1, 13), targets.view(-1)))


def test_label_smoothing_is_torch_label_smoothing():
    logits, targets = _data()
    got = build_loss({"name": "label_smoothing", "smoothing": 0.2}, REGISTRY)(logits, targets)
    want = F.cross_entropy(logits.view(-1, 13), targets.view(-1), label_smoothing=0.2)
    assert torch.allclose(got, want, atol=1e-6)


def test_z_loss_adds_weighted_log_z_squared_and_reports_both_parts():
    logits, targets = _data()
    loss_fn = build_loss({"name": "z_loss", "weight": 1e-2}, REGISTRY)
    got = loss_fn(logits, targets)
    keep = targets.view(-1) != -100
    log_z = torch.logsumexp(logits.view(-1, 13), -1)[keep]
    ce = F.cross_entropy(logits.view(-1, 13), targets.view(-1))
    assert torch.allclose(got, ce + 1e-2 * log_z.square().mean(), atol=1e-6)
    _, metrics = loss_fn.pop_side_outputs()
    assert torch.allclose(metrics["cross_entropy"], ce, atol=1e-6)
    assert torch.allclose(metrics["z_loss"], 1e-2 * log_z.square().mean(), atol=1e-6)


def test_shape_mismatch_is_a_clear_error():
    logits, targets = _data()
    with pytest.raises(ValueError, match="disagree"):
        build_loss("cross_entropy", REGISTRY)(logits, targets[:, :-1])


def test_build_loss_errors_are_user_errors():
    with pytest.raises(LlmkitError, match="did you mean 'z_loss'"):
        build_loss("zloss", REGISTRY)
    with pytest.raises(LlmkitError, match="smoothing"):
        build_loss({"name": "label_smoothing", "smoothing": 1.5}, REGISTRY)
    with pytest.raises(
        LlmkitError, match=r"unknown option 'wieght' \(allowed: ignore_index, weight\)"
    ):
        build_loss({"name": "z_loss", "wieght": 1.0}, REGISTRY)
    bare = Registry()
    bare.load_entry_points([])
    with pytest.raises(LlmkitError, match="llmkit-losses plugin is not loaded"):
        build_loss("z_loss", bare)


def test_a_custom_training_loop_with_z_loss():
    spec = {
        "model": {"vocab_size": 32, "d_model": 16, "n_layers": 1, "n_heads": 2, "max_seq_len": 8}
    }
    from llmkit import build_model

    torch.manual_seed(0)
    model = build_model(load_spec_dict(spec, registry=REGISTRY))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn = build_loss({"name": "z_loss", "weight": 1e-3}, REGISTRY)
    idx = torch.randint(0, 32, (4, 9))
    losses = []
    for _ in range(20):
        out = model(idx[:, :-1])
        loss = loss_fn(out.logits, idx[:, 1:]) + sum(out.aux_losses.values())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_cli_lists_and_shows_the_kind(capsys):
    reset_registry(REGISTRY)
    try:
        assert main(["list", "loss"]) == 0
        out = capsys.readouterr().out
        assert "z_loss" in out and "llmkit-losses" in out
        assert main(["show", "loss", "label_smoothing"]) == 0
        assert "smoothing" in capsys.readouterr().out
    finally:
        reset_registry()
