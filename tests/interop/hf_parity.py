"""Shared checks of the Hugging Face parity tests: a small random HF model saved locally,
imported, compared with transformers (logits, left-padded prompts, greedy decoding with our KV
cache), exported and loaded back by transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from llmkit.inference import Sampling, generate_batch
from llmkit.interop import hf_files
from llmkit.interop.convert import hf_to_llmkit, llmkit_to_hf

TOL = 1e-4


def make_hf(config_cls: str, model_cls: str, path: Path, seed: int = 0, **config: Any):
    """A random HF model (eval mode) built from a small config and saved to ``path``."""
    import transformers

    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(**config)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # larger weights than the 0.02 init: logits far from ties
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.08)
            elif "norm" in name or "ln" in name:
                p.uniform_(0.8, 1.2) if p.abs().mean() > 0.5 else p.uniform_(-0.2, 0.2)
            else:
                p.normal_(0.0, 0.05)
    model.save_pretrained(path)
    return model


def prompts(vocab: int, lengths=(7, 3, 12), seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def left_padded(batch: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(p) for p in batch)
    ids = torch.tensor([[pad] * (n - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in batch])
    return ids, mask


def hf_positions(mask: torch.Tensor) -> torch.Tensor:
    """The positions ``generate`` gives a left-padded batch (real tokens before each token):
    a plain forward call would number the pads too, which moves absolute positions."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def max_logit_gap(hf_model, ours, ids: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """max |Δlogit| over the real tokens of a (left-padded) batch."""
    import inspect

    extra = {}
    if mask is not None and "position_ids" in inspect.signature(hf_model.forward).parameters:
        extra["position_ids"] = hf_positions(mask)
    theirs = hf_model(input_ids=ids, attention_mask=mask, **extra).logits
    mine = ours(ids, key_padding_mask=None if mask is None else mask.bool()).logits
    keep = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    return (theirs - mine).abs()[keep].max().item()


@torch.no_grad()
def hf_greedy(hf_model, batch: list[list[int]], n: int) -> list[list[int]]:
    ids, mask = left_padded(batch)
    out = hf_model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        num_beams=1,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[:, ids.shape[1] :].tolist()


def our_greedy(model, batch: list[list[int]], n: int) -> list[list[int]]:
    cfg = Sampling(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return [r.ids for r in generate_batch(model, batch, cfg)]


def check_family(tmp_path: Path, config_cls: str, model_cls: str, *, attention="sdpa",
                 new_tokens: int = 32, lengths=(7, 3, 12),
                 unkept_rows: dict[str, int] | None = None,
                 **config: Any) -> dict[str, float]:  # fmt: skip
    """The whole parity check for one config (see the module doc); the gaps measured.

    ``unkept_rows``: HF tensor → how many of its leading rows llmkit does not hold (OPT's
    two position-offset rows, which transformers never reads for a real token): export
    writes zeros there, and the other rows are compared bit for bit.
    """
    import transformers

    src = tmp_path / "hf"
    hf_model = make_hf(config_cls, model_cls, src, **config)
    imported = hf_to_llmkit(src, attention=attention)
    ours = imported.model
    vocab = config["vocab_size"]
    ids = torch.tensor(prompts(vocab, lengths=(19, 19)))
    gaps = {"logits": max_logit_gap(hf_model, ours, ids)}
    assert gaps["logits"] <= TOL
    batch = prompts(vocab, lengths)
    padded, mask = left_padded(batch)
    gaps["left_padded"] = max_logit_gap(hf_model, ours, padded, mask)
    assert gaps["left_padded"] <= TOL
    assert our_greedy(ours, batch, new_tokens) == hf_greedy(hf_model, batch, new_tokens)

    cfg, tensors = llmkit_to_hf(ours, imported.spec)
    original = hf_files.read_weights(src)
    assert set(tensors) <= set(original)
    for name, t in tensors.items():
        n = (unkept_rows or {}).get(name, 0)
        assert torch.equal(t[n:], original[name][n:]), name
        assert not t[:n].any(), name
    out = tmp_path / "exported"
    out.mkdir()
    hf_files.write_json(out / hf_files.CONFIG, cfg)
    hf_files.write_weights(tensors, out)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == model_cls
    gaps["exported"] = max_logit_gap(back, ours, padded, mask)
    assert gaps["exported"] <= TOL
    return gaps


@torch.no_grad()
def check_export(tmp_path: Path, raw: dict[str, Any], model_cls: str) -> dict[str, Any]:
    """An llmkit spec's random model (``extends`` names a preset) exports as ``model_cls``
    and transformers loads it back with the same logits; the HF config written."""
    import transformers

    from llmkit.model import build_model
    from llmkit.spec import resolve
    from llmkit.spec.files import load_raw, merge, presets

    if "extends" in raw:
        raw = merge(load_raw(presets()[raw["extends"]]), raw)
    rs = resolve(raw)
    torch.manual_seed(0)
    model = build_model(rs).eval()
    cfg, tensors = llmkit_to_hf(model, rs)
    hf_files.write_json(tmp_path / hf_files.CONFIG, cfg)
    hf_files.write_weights(tensors, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back).__name__ == model_cls
    ids = torch.tensor(prompts(rs.model.vocab_size, lengths=(19, 19)))
    assert max_logit_gap(back, model, ids) <= TOL
    return cfg


def save_tokenizer(path: Path, text: str, vocab_size: int) -> int:
    """A small byte-level BPE with EOS and BOS, trained on ``text``'s lines and saved as
    transformers would; its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(text.splitlines(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<s>")
    fast.save_pretrained(path)
    return tok.get_vocab_size()
