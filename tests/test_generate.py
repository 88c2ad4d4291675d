"""Decoding strategies, stop conditions, streaming, the Generator API and the CLI."""

from __future__ import annotations

import io
import itertools
import json
import math

import pytest
import torch

from llmkit import cli
from llmkit.data.tokenizer import train_bpe, train_char
from llmkit.inference import (
    GenerationResult,
    Generator,
    IncrementalDecoder,
    Sampling,
    apply_repetition_penalty,
    filter_logits,
    generate_batch,
    generate_ids,
    prepare_for_decoding,
)
from llmkit.model import build_model
from llmkit.registry import get_registry
from llmkit.runs import TOKENIZER_FILE, save_spec
from llmkit.runs.checkpoints import WEIGHTS, save_weights
from llmkit.spec import load_spec_dict
from tests.helpers import tiny_spec


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


CORPUS = "the quick brown fox jumps over the lazy dog.\n" * 3


@pytest.fixture(scope="module")
def char_tok():
    return train_char([CORPUS])


@pytest.fixture(scope="module")
def lm(char_tok):
    """A random tiny model over a character vocabulary (rope, so batches may be padded)."""
    torch.manual_seed(0)
    spec = tiny_spec(
        vocab_size=char_tok.vocab_size, position={"name": "rope"}, max_seq_len=64, init_std=0.2
    )
    return build_model(load_spec_dict(spec)).eval()


@torch.no_grad()
def _logprob(model, prompt: list[int], ids: list[int]) -> float:
    seq = torch.tensor([prompt + ids])
    logp = model(seq).logits[0].float().log_softmax(-1)
    return sum(float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(ids))


# -- logits processing ------------------------------------------------------------------------


def test_top_k_and_top_p_filtering():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    kept = torch.isfinite(filter_logits(logits, 2, None))
    assert kept.tolist() == [[True, True, False, False]]
    probs = logits.softmax(-1)[0]  # ≈ 0.64, 0.24, 0.09, 0.03
    kept = torch.isfinite(filter_logits(logits, None, 0.7))
    assert kept.tolist() == [[True, True, False, False]]
    assert probs[0] < 0.7 < probs[0] + probs[1]
    kept = torch.isfinite(filter_logits(logits, None, 0.5))
    assert kept.tolist() == [[True, False, False, False]]


def test_min_p_keeps_tokens_above_a_fraction_of_the_top_probability():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]]).log_softmax(-1)
    probs = logits.exp()[0]  # ≈ 0.64, 0.24, 0.09, 0.03
    kept = torch.isfinite(filter_logits(logits, None, None, min_p=0.3))
    assert kept.tolist() == [[True, True, False, False]]
    assert probs[1] >= 0.3 * probs[0] > probs[2]
    assert torch.isfinite(filter_logits(logits, None, None, min_p=1.0)).sum() == 1


def test_repetition_penalty_follows_ctrl():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    seen = torch.tensor([[True, True, False]])
    out = apply_repetition_penalty(logits, seen, 2.0)
    assert out.tolist() == [[1.0, -4.0, 1.0]]
    assert torch.equal(apply_repetition_penalty(logits, seen, 1.0), logits)


def test_repetition_penalty_changes_greedy_output(lm):
    prompt = [[3, 4, 5]]
    plain = generate_batch(lm, prompt, Sampling(max_new_tokens=20, temperature=0))[0].ids
    assert len(set(plain)) < len(plain)  # a random tiny model repeats itself
    strong = Sampling(max_new_tokens=20, temperature=0, repetition_penalty=1e6)
    penalized = generate_batch(lm, prompt, strong)[0].ids
    assert penalized != plain
    assert len(set(penalized[:10])) == 10 and not set(penalized[:10]) & {3, 4, 5}


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -1.0},
        {"top_k": 0},
        {"top_p": 0.0},
        {"min_p": 1.5},
        {"repetition_penalty": 0.0},
        {"num_beams": 0},
        {"num_beams": 2, "top_k": 5},
        {"max_new_tokens": -1},
        {"stop": [""]},
    ],
)
def test_bad_settings_are_refused(lm, bad):
    with pytest.raises(ValueError):
        generate_batch(lm, [[1]], Sampling(**bad))


# -- greedy and sampling ----------------------------------------------------------------------


def test_greedy_generation_matches_argmax_of_full_forward():
    torch.manual_seed(0)
    model = build_model(load_spec_dict(tiny_spec(position={"name": "rope"}))).eval()
    prompt = torch.randint(0, 64, (1, 5))
    new = generate_ids(model, prompt, Sampling(max_new_tokens=6, temperature=0))
    seq = prompt
    for _ in range(6):
        nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    assert torch.equal(new, seq[:, 5:])


def test_generation_goes_past_max_seq_len_and_seed_reproduces():
    model = build_model(load_spec_dict(tiny_spec(max_seq_len=16))).eval()  # learned positions
    prompt = torch.randint(0, 64, (2, 10))
    cfg = Sampling(max_new_tokens=40, temperature=1.0, top_k=10, seed=3)
    a, b = generate_ids(model, prompt, cfg), generate_ids(model, prompt, cfg)
    assert a.shape == (2, 40) and torch.equal(a, b)
    c = generate_ids(model, prompt, Sampling(max_new_tokens=40, temperature=1.0, seed=4))
    assert not torch.equal(a, c)


def test_top_k_one_is_greedy_and_filters_restrict_the_sample(lm):
    prompt = [[1, 2, 3]]
    greedy = generate_batch(lm, prompt, Sampling(max_new_tokens=15, temperature=0))[0].ids
    top1 = generate_batch(lm, prompt, Sampling(max_new_tokens=15, top_k=1, seed=0))[0].ids
    assert top1 == greedy
    tiny_p = generate_batch(lm, prompt, Sampling(max_new_tokens=15, top_p=1e-6, seed=0))[0]
    assert tiny_p.ids == greedy
    min_p = generate_batch(lm, prompt, Sampling(max_new_tokens=15, min_p=1.0, seed=5))[0]
    assert min_p.ids == greedy


def test_sampling_follows_the_model_distribution():
    """Many one-token samples: frequencies match softmax(logits / T) (χ²-style bound)."""
    torch.manual_seed(0)
    model = build_model(load_spec_dict(tiny_spec(vocab_size=8, init_std=0.5))).eval()
    prompt = [2, 5]
    probs = (model(torch.tensor([prompt])).logits[0, -1] / 0.7).softmax(-1)
    n = 4000
    res = generate_batch(model, [prompt] * n, Sampling(max_new_tokens=1, temperature=0.7, seed=1))
    counts = torch.bincount(torch.tensor([r.ids[0] for r in res]), minlength=8).float()
    expected = probs.detach() * n
    assert float(((counts - expected).abs() / expected.sqrt().clamp(min=1)).max()) < 5


def test_eos_ends_a_row_and_the_others_go_on(lm):
    prompts = [[1, 2, 3], [4, 5]]
    free = generate_batch(lm, prompts, Sampling(max_new_tokens=12, temperature=0))
    ids = free[0].ids
    j = next(j for j, t in enumerate(ids) if j > 0 and t not in ids[:j])
    eos = ids[j]
    res = generate_batch(lm, prompts, Sampling(max_new_tokens=12, temperature=0, eos_id=eos))
    assert res[0].finish_reason == "eos" and res[0].ids == ids[: j + 1]
    if eos not in free[1].ids:
        assert res[1].finish_reason == "length" and res[1].ids == free[1].ids
    ignored = Sampling(max_new_tokens=12, temperature=0, eos_id=eos, ignore_eos=True)
    assert generate_batch(lm, prompts, ignored)[0].ids == free[0].ids
    padded = generate_ids(lm, torch.tensor([[1, 2, 3]]), Sampling(12, temperature=0, eos_id=eos))
    assert padded.shape == (1, j + 1)


# -- beam search ------------------------------------------------------------------------------


def test_beam_search_is_exact_when_it_keeps_every_prefix():
    """With V² beams over 3 tokens nothing is pruned: the best of all V³ sequences wins."""
    torch.manual_seed(1)
    model = build_model(load_spec_dict(tiny_spec(vocab_size=5, init_std=0.5))).eval()
    prompt = [1, 3]
    best = max(
        (list(seq) for seq in itertools.product(range(5), repeat=3)),
        key=lambda s: _logprob(model, prompt, s),
    )
    cfg = Sampling(max_new_tokens=3, num_beams=25, length_penalty=0.0)
    res = generate_batch(model, [prompt], cfg)[0]
    assert res.ids == best and res.finish_reason == "length"
    assert res.score == pytest.approx(_logprob(model, prompt, best), abs=1e-4)


@torch.no_grad()
def reference_beam_search(model, prompt, k, n, eos, length_penalty, early_stopping):
    """Beam search as in Hugging Face transformers, written plainly (full forwards)."""
    beams = [(0.0, [])]
    done: list[tuple[float, list[int]]] = []
    for step in range(n):
        cands = []
        for score, ids in beams:
            logp = model(torch.tensor([prompt + ids])).logits[0, -1].log_softmax(-1)
            cands += [(score + float(lp), [*ids, t]) for t, lp in enumerate(logp)]
        cands.sort(key=lambda c: c[0], reverse=True)
        beams = []
        for rank, (score, ids) in enumerate(cands[: 2 * k]):
            if ids[-1] == eos:
                if rank < k:
                    done = sorted([*done, (score / len(ids) ** length_penalty, ids)])[::-1][:k]
                continue
            beams.append((score, ids))
            if len(beams) == k:
                break
        if len(done) == k:
            best_running = max(s for s, _ in beams) / (step + 1) ** length_penalty
            if early_stopping or best_running <= done[-1][0]:
                return done[0]
    for score, ids in beams:
        done = sorted([*done, (score / len(ids) ** length_penalty, ids)])[::-1][:k]
    return done[0]


@pytest.mark.parametrize(("early", "length_penalty"), [(True, 1.0), (False, 1.0), (True, 2.0)])
def test_beam_search_with_eos_matches_a_plain_reference(early, length_penalty):
    torch.manual_seed(3)
    model = build_model(load_spec_dict(tiny_spec(vocab_size=6, init_std=0.4))).eval()
    for prompt in ([1, 2], [4], [0, 5, 3]):
        eos = generate_batch(model, [prompt], Sampling(max_new_tokens=2, temperature=0))[0].ids[1]
        want_score, want_ids = reference_beam_search(
            model, prompt, 3, 7, eos, length_penalty, early
        )
        cfg = Sampling(
            max_new_tokens=7,
            num_beams=3,
            eos_id=eos,
            length_penalty=length_penalty,
            early_stopping=early,
        )
        got = generate_batch(model, [prompt], cfg)[0]
        assert got.ids == want_ids
        assert got.score == pytest.approx(want_score, abs=1e-5)


def test_beam_search_beats_greedy_and_reports_normalized_scores(lm):
    prompts = [[1, 2, 3, 4], [9]]
    greedy = generate_batch(lm, prompts, Sampling(max_new_tokens=8, temperature=0))
    beams = generate_batch(lm, prompts, Sampling(max_new_tokens=8, num_beams=4))
    for prompt, g, b in zip(prompts, greedy, beams):
        assert len(b.ids) == 8
        assert b.score == pytest.approx(_logprob(lm, prompt, b.ids) / 8, abs=1e-4)
        assert _logprob(lm, prompt, b.ids) >= _logprob(lm, prompt, g.ids) - 1e-4
    alone = generate_batch(lm, prompts[1:], Sampling(max_new_tokens=8, num_beams=4))[0]
    assert alone.ids == beams[1].ids  # left padding does not change the search


def test_beam_search_finishes_hypotheses_at_eos(lm):
    prompt = [[1, 2, 3]]
    free = generate_batch(lm, prompt, Sampling(max_new_tokens=6, num_beams=3))[0]
    eos = free.ids[1]
    res = generate_batch(lm, prompt, Sampling(max_new_tokens=6, num_beams=3, eos_id=eos))[0]
    assert res.finish_reason in ("eos", "length")
    if res.finish_reason == "eos":
        assert res.ids[-1] == eos and eos not in res.ids[:-1]
    lazy = Sampling(max_new_tokens=6, num_beams=3, eos_id=eos, early_stopping=False)
    assert generate_batch(lm, prompt, lazy)[0].score is not None


# -- text: stop strings, incremental decoding, streaming ---------------------------------------


def test_incremental_decoder_holds_back_partial_utf8_pieces():
    tok = train_bpe(["hello world héllo wörld 😀 ok"] * 5, 300)
    text = "héllo 😀 日本 wörld"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some tokens are partial bytes
    dec = IncrementalDecoder(tok)
    pieces = [dec.push(i) for i in ids]
    pieces.append(dec.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_stop_strings_cut_the_text_and_end_the_row(lm, char_tok):
    gen = Generator(lm, char_tok)
    base = gen.generate("the ", max_new_tokens=30, temperature=0, eos_id=-1)[0]
    assert len(base.text) == 30
    stop = base.text[10:13]
    first = base.text.find(stop)
    res = gen.generate("the ", max_new_tokens=30, temperature=0, stop=stop, eos_id=-1)[0]
    assert res.finish_reason == "stop"
    assert res.text == base.text[:first]
    assert res.ids == base.ids[: first + len(stop)]  # through the token that completed it
    streamed = gen.stream("the ", max_new_tokens=30, temperature=0, stop=[stop], eos_id=-1)
    pieces = list(streamed)
    assert "".join(pieces) == res.text and streamed.result == res
    beams = gen.generate("the ", max_new_tokens=30, num_beams=2, stop=stop, eos_id=-1)[0]
    assert stop not in beams.text


def test_stream_yields_the_same_text_as_generate(lm, char_tok):
    gen = Generator(lm, char_tok)
    kw = {"max_new_tokens": 25, "temperature": 0.9, "seed": 7}
    full = gen.generate("over ", **kw)[0]
    stream = gen.stream("over ", **kw)
    pieces = list(stream)
    assert len(pieces) > 1 and "".join(pieces) == full.text
    assert stream.result is not None and stream.result.ids == full.ids
    with pytest.raises(ValueError, match="beam"):
        gen.stream("over ", num_beams=2)


def test_generator_batches_text_prompts_and_fills_in_eos(lm, char_tok):
    gen = Generator(lm, char_tok)
    prompts = ["the quick ", "a", "lazy dog"]
    batched = gen.generate(prompts, max_new_tokens=10, temperature=0)
    assert [len(r.prompt_ids) for r in batched] == [10, 1, 8]
    for prompt, r in zip(prompts, batched):
        assert isinstance(r, GenerationResult)
        assert r == gen.generate(prompt, max_new_tokens=10, temperature=0)[0]
        assert r.text == char_tok.decode(r.ids[:-1] if r.finish_reason == "eos" else r.ids)
    assert gen.sampling().eos_id == char_tok.eos_id
    assert gen.generate([3, 4], max_new_tokens=2)[0].prompt_ids == [3, 4]  # token ids
    assert gen.generate("", max_new_tokens=2)[0].prompt_ids == [char_tok.eos_id]


def test_generate_leaves_training_mode_alone(lm):
    lm.train()
    try:
        generate_batch(lm, [[1]], Sampling(max_new_tokens=2))
        assert lm.training
    finally:
        lm.eval()


# -- the command line -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, char_tok):
    """A run directory with random weights (no training needed to test the commands)."""
    path = tmp_path_factory.mktemp("run")
    spec = tiny_spec(vocab_size=char_tok.vocab_size, position={"name": "rope"}, max_seq_len=64)
    spec["tokenizer"] = {"kind": "char"}
    rs = load_spec_dict(spec)
    torch.manual_seed(0)
    save_spec(rs, path)
    save_weights(build_model(rs), path / WEIGHTS)
    char_tok.save(path / TOKENIZER_FILE)
    return path


def test_cli_generate_prints_prompt_and_continuation(run_dir, capsys):
    args = ["--max-new-tokens", "12", "--temperature", "0", "--ignore-eos"]
    assert cli.main(["generate", str(run_dir), "--prompt", "the ", *args]) == 0
    out = capsys.readouterr().out
    expected = Generator(str(run_dir)).generate("the ", max_new_tokens=12, temperature=0)
    assert out == "the " + expected[0].text + "\n"
    assert cli.main(["generate", str(run_dir), "--prompt", "the ", "--stream", *args]) == 0
    assert capsys.readouterr().out == out


def test_cli_generate_json_batch_and_beams(run_dir, capsys):
    argv = ["generate", str(run_dir), "--prompt", "a", "--prompt", "dog", "--json"]
    assert cli.main([*argv, "--max-new-tokens", "5", "--num-beams", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [o["prompt"] for o in out] == ["a", "dog"]
    assert all(o["score"] is not None and o["finish_reason"] for o in out)


def test_cli_generate_interactive_reads_prompts_until_exit(run_dir, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("the\nfox\nexit\nnever read\n"))
    argv = ["generate", str(run_dir), "--interactive", "--stream", "--max-new-tokens", "6"]
    assert cli.main([*argv, "--temperature", "0", "--ignore-eos"]) == 0
    lines = capsys.readouterr().out.splitlines()
    gen = Generator(str(run_dir))
    want = [gen.generate(p, max_new_tokens=6, temperature=0, ignore_eos=True)[0].text
            for p in ("the", "fox")]  # fmt: skip
    assert "\n".join(lines) == "\n".join(want)


def test_cli_generate_refuses_bad_settings(run_dir, capsys):
    assert cli.main(["generate", str(run_dir), "--top-p", "2"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert cli.main(["generate", str(run_dir), "--num-beams", "2", "--stream"]) == 2
    assert "--stream" in capsys.readouterr().err


def test_result_text_never_contains_a_replacement_for_whole_characters(lm, char_tok):
    res = Generator(lm, char_tok).generate("the", max_new_tokens=20, temperature=1.0, seed=1)
    assert "\ufffd" not in res[0].text and math.isfinite(len(res[0].ids))


# -- benchmarking -----------------------------------------------------------------------------


def test_bench_generate_reports_every_figure_and_a_bounded_window_cache():
    from llmkit.bench.generation import bench_generate

    spec = tiny_spec(attention={"name": "sliding_window", "window": 4}, max_seq_len=64)
    model = build_model(load_spec_dict(spec))
    short, long = (
        bench_generate(model, batch_sizes=(2,), prompt_len=8, new_tokens=n, repeats=1)[0]
        for n in (4, 40)
    )
    assert long.kv_cache and long.batch_size == 2 and long.new_tokens == 40
    assert long.prefill_tokens_per_s > 0 and long.decode_tokens_per_s > 0 and long.ttft_s > 0
    assert long.peak_memory_bytes > long.weight_bytes > 0
    assert long.kv_cache_bytes == short.kv_cache_bytes > 0  # the window bounds the cache
    dense = build_model(load_spec_dict(tiny_spec(max_seq_len=64)))
    grown = bench_generate(dense, batch_sizes=(2,), prompt_len=8, new_tokens=40, repeats=1)[0]
    assert grown.kv_cache_bytes > long.kv_cache_bytes


def test_cli_bench_generate_json(run_dir, capsys):
    argv = ["bench", "generate", str(run_dir), "--batch-sizes", "1,2", "--prompt-len", "4"]
    assert cli.main([*argv, "--new-tokens", "3", "--repeats", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["batch_size"] for r in out["results"]] == [1, 2]
    assert {"prefill_tokens_per_s", "decode_tokens_per_s", "ttft_s", "peak_memory_bytes"} <= set(
        out["results"][0]
    )
    assert cli.main([*argv, "--new-tokens", "3", "--repeats", "1", "--quantize", "int8"]) == 0
    assert "decode tok/s" in capsys.readouterr().out
    assert cli.main(["bench", "generate", str(run_dir), "--batch-sizes", "x"]) == 2


def test_decoding_layout_keeps_values_ties_and_training(tmp_path, run_dir):
    torch.manual_seed(0)
    model = build_model(load_spec_dict(tiny_spec(position={"name": "rope"}))).eval()
    before = model.lm_head.weight.detach().clone()
    idx = torch.randint(0, 64, (2, 8))
    logits = model(idx).logits.detach()
    generate_batch(model, [[1, 2, 3]], Sampling(max_new_tokens=3, temperature=0))
    assert model.lm_head.weight.is_contiguous()  # a model passed in is left alone
    prepare_for_decoding(model)
    w = model.lm_head.weight
    assert w.stride() == (1, 64)  # column-major on CPU
    assert w is model.tok_emb.weight and torch.equal(w, before)
    torch.testing.assert_close(model(idx).logits, logits, atol=1e-5, rtol=1e-5)
    model.train()
    model(idx, idx).loss.backward()  # still an ordinary trainable parameter
    assert w.grad is not None and w.grad.shape == w.shape
    prepare_for_decoding(model, column_major=False)
    assert w.is_contiguous() and torch.equal(w, before)
    save_weights(model, tmp_path / WEIGHTS)
    loaded = Generator(str(run_dir)).model  # models llmkit loads get the layout
    assert loaded.lm_head.weight.stride() == (1, loaded.lm_head.weight.shape[0])


def _is_col(w: torch.Tensor) -> bool:
    return w.stride() == (1, w.shape[0])


def test_decoding_layout_follows_the_number_of_rows():
    """Linears with out ≥ in and the head go column-major for one or two rows, back to
    row-major for more, and the generated tokens never depend on the layout."""
    torch.manual_seed(0)
    model = build_model(load_spec_dict(tiny_spec(ffn={"name": "mlp", "multiplier": 4.0}))).eval()
    plain = build_model(load_spec_dict(tiny_spec(ffn={"name": "mlp", "multiplier": 4.0}))).eval()
    plain.load_state_dict(model.state_dict())
    block = model.layers[0]
    wide, narrow = block.ffn.in_proj.weight, block.ffn.out_proj.weight  # (128, 32), (32, 128)
    cfg = Sampling(max_new_tokens=6, temperature=0, ignore_eos=True)
    one, four = [[1, 2, 3]], [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]

    prepare_for_decoding(model)
    assert _is_col(wide) and _is_col(block.attn.qkv.weight) and _is_col(model.lm_head.weight)
    assert narrow.is_contiguous() and not _is_col(narrow)  # fewer outputs than inputs
    assert generate_batch(model, one, cfg)[0].ids == generate_batch(plain, one, cfg)[0].ids
    assert _is_col(wide)
    got = [r.ids for r in generate_batch(model, four, cfg)]
    assert wide.is_contiguous() and model.lm_head.weight.is_contiguous()  # switched back
    assert got == [r.ids for r in generate_batch(plain, four, cfg)]
    beams = Sampling(max_new_tokens=4, num_beams=3)
    generate_batch(model, one, beams)  # 3 rows decode at once
    assert wide.is_contiguous()
    generate_batch(model, one, cfg)
    assert _is_col(wide)  # and back again for one row
    assert plain.layers[0].ffn.in_proj.weight.is_contiguous()  # never prepared: left alone

    prepare_for_decoding(model, column_major=False)
    assert wide.is_contiguous() and model.lm_head.weight.is_contiguous()
    generate_batch(model, one, cfg)
    assert wide.is_contiguous()  # switching stopped


@pytest.mark.parametrize("ffn", [c.name for c in get_registry().list("ffn")])
def test_every_feed_forward_accepts_the_decoding_layout(ffn):
    torch.manual_seed(0)
    model = build_model(load_spec_dict(tiny_spec(ffn={"name": ffn}))).eval()
    idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(idx).logits
        prepare_for_decoding(model)
        torch.testing.assert_close(model(idx).logits, before, atol=1e-5, rtol=1e-5)
        cache = model.new_cache()
        inc = torch.cat(
            [model(idx[:, :5], cache=cache).logits]
            + [model(idx[:, t : t + 1], cache=cache).logits for t in range(5, 8)],
            1,
        )
    torch.testing.assert_close(inc, before, atol=2e-5, rtol=1e-4)
