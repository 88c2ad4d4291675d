"""Hostile inputs to the generation API, each refused with a :class:`GenerationError` (a
``ValueError`` and an ``LlmkitError``: one line from the CLI) instead of a traceback, a
crash in torch or a silent garbage result: settings that are NaN, infinite, out of range or
of the wrong type; text that is not valid Unicode; token ids outside the vocabulary; weights
and logits that hold NaN; a batch too large for the memory left."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from llmkit.data.tokenizer import train_char
from llmkit.errors import LlmkitError
from llmkit.inference import GenerationError, Generator, Sampling, checks, decode, generate_batch
from llmkit.inference.decode import DecodeContext
from llmkit.inference.sampling import MAX_NEW_TOKENS, MAX_NUM_BEAMS
from llmkit.model import build_model
from llmkit.runs import TOKENIZER_FILE, save_spec
from llmkit.runs.checkpoints import WEIGHTS, save_weights
from llmkit.spec import load_spec_dict
from tests.helpers import tiny_spec

NAN, INF = float("nan"), float("inf")

# -- settings --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"temperature": NAN}, "temperature must be a finite number"),
        ({"temperature": INF}, "temperature must be a finite number"),
        ({"temperature": -0.5}, "temperature must be ≥ 0"),
        ({"temperature": "1"}, "temperature must be a number"),
        ({"top_p": NAN}, "top_p must be a finite number"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"top_p": -INF}, "top_p must be a finite number"),
        ({"min_p": NAN}, "min_p must be a finite number"),
        ({"top_k": -3}, "top_k must be ≥ 1"),
        ({"top_k": 0}, "top_k must be ≥ 1"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"top_k": True}, "top_k must be an integer"),
        ({"repetition_penalty": NAN}, "repetition_penalty must be a finite number"),
        ({"repetition_penalty": INF}, "repetition_penalty must be a finite number"),
        ({"repetition_penalty": -1.0}, "repetition_penalty must be > 0"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"num_beams": 2, "length_penalty": NAN}, "length_penalty must be a finite number"),
        ({"num_beams": 2, "length_penalty": -INF}, "length_penalty must be a finite number"),
        ({"num_beams": 10**9}, f"num_beams must be in [1, {MAX_NUM_BEAMS}]"),
        ({"num_beams": MAX_NUM_BEAMS + 1}, "num_beams must be in"),
        ({"num_beams": 0}, "num_beams must be in"),
        ({"max_new_tokens": 10**20}, "max_new_tokens must be in [0, 1,000,000]"),
        ({"max_new_tokens": MAX_NEW_TOKENS + 1}, "max_new_tokens must be in"),
        ({"max_new_tokens": 2.0}, "max_new_tokens must be an integer"),
        ({"seed": 2**64}, "seed must be in"),
        ({"seed": "7"}, "seed must be an integer"),
        ({"eos_id": "a"}, "eos_id must be a token id or ids"),
        ({"eos_id": [1, 2.5]}, "eos_id must be an integer"),
        ({"stop": ["\udcff"]}, "not valid UTF-8 (byte 0xff at character 0)"),
        ({"stop": [3]}, "stop strings must be text"),
    ],
)
def test_impossible_settings_are_refused_by_the_api(lm, bad, message):
    cfg = Sampling(**bad)
    with pytest.raises(GenerationError) as err:
        generate_batch(lm, [[1]], cfg)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert isinstance(err.value, ValueError) and isinstance(err.value, LlmkitError)
    with pytest.raises(GenerationError):
        cfg.validate()


def test_settings_at_the_limits_are_accepted(lm):
    Sampling(max_new_tokens=MAX_NEW_TOKENS, num_beams=MAX_NUM_BEAMS, seed=-1).validate()
    Sampling(temperature=0, top_p=1.0, min_p=0.0, eos_id=[-1, 3], length_penalty=-2).validate()
    out = generate_batch(lm, [[1]], Sampling(max_new_tokens=2, top_k=10**9, temperature=1e3))
    assert len(out[0].ids) == 2


# -- text ------------------------------------------------------------------------------------


def test_text_problem_reads_back_the_escaped_byte():
    assert checks.text_problem("fine ✓") is None
    assert checks.text_problem(b"ab\xfe".decode("utf-8", "surrogateescape")) == (
        "not valid UTF-8 (byte 0xfe at character 2)"
    )
    assert "lone surrogate U+D800" in checks.text_problem("x\ud800")


def test_prompts_that_are_not_valid_text_are_refused(lm, char_tok):
    gen = Generator(lm, char_tok)
    bad = b"the \xff".decode("utf-8", "surrogateescape")
    with pytest.raises(GenerationError, match=r"^the prompt: not valid UTF-8 \(byte 0xff"):
        gen.generate(bad, max_new_tokens=1)
    with pytest.raises(GenerationError, match=r"^prompt 2: not valid UTF-8"):
        gen.generate(["the", bad], max_new_tokens=1)
    with pytest.raises(GenerationError, match=r"^the prompt: not valid UTF-8"):
        gen.stream(bad, max_new_tokens=1)


def test_chat_messages_that_are_not_valid_text_are_refused(lm):
    tok = train_char(["the quick brown fox\n"])
    tok.chat_template = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    gen = Generator(lm, tok)
    assert gen.chat_prompt([{"role": "user", "content": "the"}])
    with pytest.raises(GenerationError, match=r"^message 2 content: not valid Unicode text"):
        gen.chat([{"role": "user", "content": "ok"}, {"role": "user", "content": "x\ud800"}])
    with pytest.raises(GenerationError, match=r"^message 1 role: not valid UTF-8 \(byte 0x80"):
        gen.chat_prompt([{"role": "\udc80", "content": "ok"}])


# -- token ids -------------------------------------------------------------------------------


@pytest.mark.parametrize("ids", [[1, 10**6], [-1, 2]])
def test_token_ids_outside_the_vocabulary_are_refused(lm, ids):
    vocab = lm.config.vocab_size
    bad = ids[-1] if ids[0] >= 0 else ids[0]
    with pytest.raises(GenerationError, match=rf"prompt 2: token id {bad} is outside"):
        generate_batch(lm, [[1], ids], Sampling(max_new_tokens=1))
    with pytest.raises(GenerationError, match=f"pad_id {vocab} is outside the vocabulary"):
        generate_batch(lm, [[1]], Sampling(max_new_tokens=1), pad_id=vocab)


# -- NaN weights and logits ------------------------------------------------------------------


def _poisoned(model, name: str, index: tuple[int, ...], value: float = NAN):
    """A copy of ``model`` with ``value`` at ``index`` of the parameter ``name``."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        dict(model.named_parameters())[name][index] = value
    return model.eval()


def test_first_nonfinite_reads_chunks_of_any_layout():
    t = torch.zeros(50, 30)
    assert checks.first_nonfinite(t, chunk=7) is None
    t[41, 17] = INF
    t[45, 2] = NAN
    assert checks.first_nonfinite(t, chunk=7) == ((41, 17), INF)
    found = checks.first_nonfinite(t.t(), chunk=64)  # column-major: no contiguous copy needed
    assert found is not None and found[0] == (2, 45) and math.isnan(found[1])
    assert checks.first_nonfinite(torch.tensor([0.0, 1.0, -INF]), chunk=1) == ((2,), -INF)
    assert checks.first_nonfinite(torch.tensor(NAN))[0] == ()


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory, char_tok):
    """A run directory whose saved weights hold one NaN (a diverged run)."""
    path = tmp_path_factory.mktemp("nan-run")
    spec = tiny_spec(vocab_size=char_tok.vocab_size, position={"name": "rope"}, max_seq_len=64)
    spec["tokenizer"] = {"kind": "char"}
    rs = load_spec_dict(spec)
    torch.manual_seed(0)
    model = build_model(rs)
    name = next(n for n, p in model.named_parameters() if n.startswith("layers.1") and p.dim() == 2)
    with torch.no_grad():
        dict(model.named_parameters())[name][1, 2] = NAN
    save_spec(rs, path)
    save_weights(model, path / WEIGHTS)
    char_tok.save(path / TOKENIZER_FILE)
    return path, name


def test_a_run_whose_weights_hold_nan_is_refused_at_load_naming_the_tensor(nan_run):
    path, name = nan_run
    with pytest.raises(GenerationError) as err:
        Generator(path)
    message = str(err.value)
    assert message.startswith(f"{path / WEIGHTS}: weight {name}[1, 2] is nan, not a finite")
    assert "\n" not in message


@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": 0},
        {"temperature": 0.8, "seed": 0},
        {"temperature": 1.0, "top_k": 5, "top_p": 0.9, "repetition_penalty": 1.3},
        {"num_beams": 3},
    ],
)
def test_nan_logits_stop_generation_with_a_clear_error(lm, settings):
    """A model handed in is not scanned at load: its NaN logits are caught when decoding
    (greedy would print garbage, sampling would crash in torch.multinomial)."""
    model = _poisoned(lm, "norm_f.weight", (0,))  # the final norm: every logit reads it
    cfg = Sampling(max_new_tokens=3, **settings)
    with pytest.raises(GenerationError, match=r"the model's logits hold NaN \(step 1, prompt 1\)"):
        generate_batch(model, [[1, 2]], cfg)


def test_nan_logits_in_one_row_name_that_prompt_and_stop_a_stream(char_tok):
    torch.manual_seed(0)
    spec = tiny_spec(
        vocab_size=char_tok.vocab_size,
        position={"name": "rope"},
        max_seq_len=64,
        tie_embeddings=False,
    )
    model = build_model(load_spec_dict(spec)).eval()
    with torch.no_grad():
        model.tok_emb.weight[7, 0] = NAN  # only a row that reads token 7 goes wrong
    cfg = Sampling(max_new_tokens=2, temperature=0.7, seed=1)
    with pytest.raises(GenerationError, match=r"\(step 1, prompt 2\)"):
        generate_batch(model, [[1, 2], [3, 7]], cfg)
    stream = Generator(model, char_tok).stream([7], cfg)
    with pytest.raises(GenerationError, match="logits hold NaN"):
        list(stream)


def test_a_temperature_that_overflows_the_probabilities_is_named(lm):
    cfg = Sampling(max_new_tokens=2, temperature=1e-45, seed=0)
    with pytest.raises(GenerationError, match=r"no finite sampling probabilities.*temperature"):
        generate_batch(lm, [[1, 2]], cfg)


# -- memory ----------------------------------------------------------------------------------


def test_a_batch_too_large_for_the_memory_left_is_refused_before_allocating(lm, monkeypatch):
    monkeypatch.setattr(checks, "available_memory", lambda device: 64 * 1024)

    def no_allocation(*args, **kwargs):
        raise AssertionError("decoding started")

    monkeypatch.setattr(decode, "DecodeContext", no_allocation)
    with pytest.raises(GenerationError) as err:
        generate_batch(lm, [[1, 2]] * 3, Sampling(num_beams=8, max_new_tokens=50))
    message = str(err.value)
    assert message.startswith("decoding 3 prompts × 8 beams needs at least ")
    assert "available on cpu" in message and "\n" not in message


def test_the_memory_estimate_is_a_lower_bound(lm):
    prompts, new = [[1, 2, 3], [4, 5]], 20
    ctx = DecodeContext(lm, prompts, 0, new)
    with torch.inference_mode():
        logits = ctx.prefill()
    held = ctx.ids.nbytes + ctx.mask.nbytes + 2 * logits.float().nbytes
    held += ctx.cache.nbytes() if ctx.cache is not None else 0
    assert 0 < checks.decoding_bytes(lm, 2, 3, new, False, False) <= held


def test_available_memory_is_known_on_the_cpu():
    have = checks.available_memory(torch.device("cpu"))
    assert have is None or have > 0
    assert checks.available_memory(torch.device("meta")) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nan_logits_on_cuda_raise_without_a_device_assert(lm):
    """torch.multinomial asserts on the device when given NaN; the row is caught first and
    the device stays usable."""
    model = _poisoned(lm, "norm_f.weight", (0,)).cuda()
    with pytest.raises(GenerationError, match="logits hold NaN"):
        generate_batch(model, [[1, 2]], Sampling(max_new_tokens=2, temperature=1.0, seed=0))
    assert torch.ones(2, device="cuda").sum().item() == 2
    have = checks.available_memory(torch.device("cuda"))
    assert have is not None and have > 0
