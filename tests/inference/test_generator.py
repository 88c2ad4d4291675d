"""The Generator API and ``llmkit generate``."""

from __future__ import annotations

import io
import json

from llmkit import cli, inference
from llmkit.inference import GenerationResult, Generator, Sampling, generate_batch


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


def test_cli_generate_interactive_json_prints_one_object_a_prompt(run_dir, capsys,
                                                                   monkeypatch):  # fmt: skip
    monkeypatch.setattr("sys.stdin", io.StringIO("the\nfox\n"))
    argv = ["generate", str(run_dir), "--interactive", "--json", "--max-new-tokens", "4"]
    assert cli.main([*argv, "--temperature", "0", "--ignore-eos"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    gen = Generator(str(run_dir))
    for record, prompt in zip(records, ("the", "fox"), strict=True):
        want = gen.generate(prompt, max_new_tokens=4, temperature=0, ignore_eos=True)[0]
        assert record["prompt"] == prompt and record["text"] == want.text
        assert record["ids"] == want.ids and record["finish_reason"] == "length"


def test_cli_generate_refuses_bad_settings(run_dir, capsys):
    assert cli.main(["generate", str(run_dir), "--top-p", "2"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert cli.main(["generate", str(run_dir), "--num-beams", "2", "--stream"]) == 2
    assert "--stream" in capsys.readouterr().err


def test_the_package_exports_its_public_api():
    assert all(hasattr(inference, name) for name in inference.__all__)
    assert {"Generator", "Sampling", "generate_batch", "prepare_for_decoding"} <= set(
        inference.__all__
    )
