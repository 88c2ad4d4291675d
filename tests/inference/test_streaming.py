"""Text as it is generated: incremental decoding, stop strings, streaming."""

from __future__ import annotations

import math

import pytest

from llmkit.data.tokenizer import train_bpe
from llmkit.inference import Generator, IncrementalDecoder


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


def test_result_text_never_contains_a_replacement_for_whole_characters(lm, char_tok):
    res = Generator(lm, char_tok).generate("the", max_new_tokens=20, temperature=1.0, seed=1)
    assert "\ufffd" not in res[0].text and math.isfinite(len(res[0].ids))


def test_a_stream_keeps_no_mode_of_its_own_between_pieces_or_after_it_is_left(lm, char_tok):
    # The loop body runs in the caller's grad mode (not inference mode); leaving the loop
    # early ends the decoding at once and gives the model back its training mode.
    import torch

    lm.train()
    try:
        stream = Generator(lm, char_tok).stream("the ", max_new_tokens=30, temperature=0,
                                                eos_id=-1)  # fmt: skip
        for i, _piece in enumerate(stream):
            assert not torch.is_inference_mode_enabled() and torch.is_grad_enabled()
            assert not lm.training  # decoding runs in eval mode
            if i == 2:
                break
        assert lm.training and not torch.is_inference_mode_enabled()
        x = torch.randint(0, char_tok.vocab_size, (2, 8))
        lm(x, x).loss.backward()  # training works right after
        assert lm.lm_head.weight.grad is not None
    finally:
        lm.zero_grad(set_to_none=True)
        lm.eval()
