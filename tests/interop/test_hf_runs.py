"""``llmkit import-hf`` / ``export-hf`` end to end: a local HF checkpoint with a tokenizer
becomes a run that generate, eval, info, bench generate and fine-tuning use, and goes back
out as a directory transformers loads (weights bit for bit)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from llmkit.cli.app import main
from llmkit.interop import hf_files
from tests.interop import hf_parity
from tests.interop.hf_parity import make_hf

TEXT = "\n".join(f"def f{i}(x):\n    return x * {i} + {i % 7}" for i in range(200))


def save_tokenizer(path: Path) -> int:
    return hf_parity.save_tokenizer(path, TEXT, vocab_size=300)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    src = tmp_path_factory.mktemp("hf") / "tiny-llama"
    src.mkdir()
    n = save_tokenizer(src)
    model = make_hf(
        "LlamaConfig",
        "LlamaForCausalLM",
        src,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=n + 4,  # padded embedding rows, as real checkpoints have
        max_position_embeddings=128,
        eos_token_id=0,
        bos_token_id=1,
    )
    return src, model


@pytest.fixture(scope="module")
def run(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "imported"
    assert main(["import-hf", str(checkpoint[0]), str(out)]) == 0
    return out


def test_import_writes_a_normal_run(run):
    for name in ("spec.yaml", "resolved.json", "model.safetensors", "tokenizer.json"):
        assert (run / name).is_file(), name
    source = json.loads((run / "hf_source.json").read_text())
    assert source["model_type"] == "llama" and source["eos_token_id"] == 0


def test_generate_matches_transformers_greedy(run, checkpoint, capsys):
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(checkpoint[0])
    prompt = "def f3(x):"
    ids = hf_tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    want = (
        checkpoint[1]
        .generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)[
            0, ids.shape[1] :
        ]
        .tolist()
    )
    capsys.readouterr()
    argv = ["generate", str(run), "--prompt", prompt, "--max-new-tokens", "12"]
    assert main([*argv, "--temperature", "0", "--ignore-eos", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = out if isinstance(out, list) else out.get("results", [out])
    assert rows[0]["ids"] == want


def test_eval_info_and_bench_work_on_the_run(run, checkpoint, tmp_path, capsys):
    text = tmp_path / "held_out.txt"
    text.write_text(TEXT[:3000])
    assert main(["eval", str(run), "--data", str(text), "--json", "--no-save"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert 0 < result["ppl"] < 1e4 and result["tokens"] > 100
    assert main(["info", str(run), "--json"]) == 0  # a run directory: its spec.yaml
    info = json.loads(capsys.readouterr().out.split("\n{", 1)[-1].join(["{", ""]))
    assert info["params"] == checkpoint[1].num_parameters()
    argv = ["bench", "generate", str(run), "--batch-sizes", "1", "--new-tokens", "4"]
    assert main([*argv, "--repeats", "1", "--prompt-len", "8"]) == 0


def finetune_spec(tmp_path: Path, run: Path, steps: int) -> Path:
    """A spec that fine-tunes the imported ``run`` for ``steps`` steps on TEXT."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    spec = tmp_path / "finetune.toml"
    spec.write_text(
        f'extends = "{run / "spec.yaml"}"\n'
        '[data]\nsource = { name = "text", paths = ["' + str(corpus) + '"] }\n'
        "block_size = 32\n"
        f'[train]\ninit_from = "{run}"\nmax_steps = {steps}\nbatch_size = 2\n'
        f"eval_interval = {steps}\neval_batches = 1\nsample_tokens = 0\nplot = false\n"
        '[schedule]\nname = "constant"\n'
    )
    return spec


def test_fine_tuning_starts_from_the_imported_run(run, tmp_path):
    spec = finetune_spec(tmp_path, run, 2)
    out = tmp_path / "ft"
    assert main(["train", str(spec), "--out", str(out), "--no-progress"]) == 0
    assert (out / "model.safetensors").is_file()
    assert (out / "tokenizer.json").read_text() == (run / "tokenizer.json").read_text()
    # the padded embedding (304 rows for 300 tokens) is kept, also when the run resumes
    assert main(["train", "--resume", str(out), "--set", "train.max_steps=3", "--no-progress"]) == 0
    assert "304" in (out / "spec.yaml").read_text()


def test_export_loads_in_transformers_bit_for_bit(run, checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "exported"
    assert main(["export-hf", str(run), str(out)]) == 0
    original = hf_files.read_weights(checkpoint[0])
    exported = hf_files.read_weights(out)
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 300, (2, 9))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, checkpoint[1](ids).logits)
    tok, ref = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(checkpoint[0])
    assert (
        tok("def g(y): return y", add_special_tokens=False).input_ids
        == ref("def g(y): return y", add_special_tokens=False).input_ids
    )
    assert tok.eos_token == "<|endoftext|>" and back.config.eos_token_id == 0


def one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) != 0
    err = capsys.readouterr().err.strip()
    assert err and len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_bad_input_is_one_line(checkpoint, run, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "config.json" in one_line_error(capsys, ["import-hf", str(empty), str(tmp_path / "a")])
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    err = one_line_error(capsys, ["import-hf", str(bert), str(tmp_path / "b")])
    assert "bert" in err and "llama" in err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((checkpoint[0] / "config.json").read_text())
    tensors = hf_files.read_weights(checkpoint[0])
    del tensors["model.layers.1.mlp.up_proj.weight"]
    hf_files.write_weights(tensors, broken)
    err = one_line_error(capsys, ["import-hf", str(broken), str(tmp_path / "c")])
    assert "model.layers.1.mlp.up_proj.weight" in err
    assert not (tmp_path / "c").exists()
    err = one_line_error(capsys, ["import-hf", str(checkpoint[0]), str(run)])
    assert "not empty" in err


def test_native_only_refuses_what_no_hf_architecture_holds(tmp_path, capsys):
    from llmkit.model import build_model
    from llmkit.runs import save_spec
    from llmkit.runs.checkpoints import save_weights
    from llmkit.spec import resolve

    raw = {
        "model": {
            "vocab_size": 50, "d_model": 32, "n_layers": 1, "n_heads": 4,
            "position": {"name": "alibi"}, "ffn": {"name": "swiglu"},
            "norm": {"name": "rmsnorm"}, "bias": False,
        }
    }  # fmt: skip
    rs = resolve(raw)
    run = tmp_path / "alibi-swiglu"
    run.mkdir()
    save_spec(rs, run)
    save_weights(build_model(rs), run / "model.safetensors")
    argv = ["export-hf", "--native-only", str(run), str(tmp_path / "out")]
    err = one_line_error(capsys, argv)
    assert "no Hugging Face architecture" in err and "alibi" in err
    assert not (tmp_path / "out").exists()
    # without --native-only it goes out as llmkit's remote code (test_hf_remote_code.py)
    assert main(["export-hf", str(run), str(tmp_path / "out")]) == 0
    assert "as remote code" in capsys.readouterr().out


def test_export_compares_options_by_their_effect():
    """A hand-written spec (hidden from a multiplier, biases following the model) exports:
    the config read back spells them out, which changes nothing."""
    from llmkit.interop.convert import hf_config_for
    from llmkit.spec import resolve

    rs = resolve(
        {
            "model": {
                "vocab_size": 64, "d_model": 48, "n_layers": 2, "n_heads": 4, "bias": False,
                "tie_embeddings": False, "position": {"name": "rope"},
                "norm": {"name": "rmsnorm", "eps": 1e-5},
                "ffn": {"name": "swiglu", "multiplier": 2.0, "multiple_of": 32},
            }
        }
    )  # fmt: skip
    _, cfg = hf_config_for(rs)
    assert cfg["model_type"] == "llama" and cfg["intermediate_size"] == 96


def test_resume_of_an_imported_run_says_how_to_start_from_it(run, capsys):
    err = one_line_error(capsys, ["train", "--resume", str(run)])
    assert "no checkpoint to resume from" in err and f"--init-from {run}" in err


def test_sharded_safetensors_and_weights_only_bin_import_alike(checkpoint, tmp_path):
    """Shards named by model.safetensors.index.json, and pytorch_model.bin (one file or
    sharded with its index) read with weights_only, give the same model."""
    from llmkit.interop.convert import hf_to_llmkit

    src, hf_model = checkpoint
    tensors = hf_files.read_weights(src)
    names = sorted(tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    config = (src / "config.json").read_text()

    def sharded(kind: str) -> Path:
        d = tmp_path / kind
        d.mkdir()
        (d / "config.json").write_text(config)
        weight_map = {}
        for i, part in enumerate(halves, 1):
            if kind == "safetensors":
                from safetensors.torch import save_file

                name = f"model-0000{i}-of-00002.safetensors"
                save_file({k: tensors[k].contiguous() for k in part}, str(d / name))
            else:
                name = f"pytorch_model-0000{i}-of-00002.bin"
                torch.save({k: tensors[k] for k in part}, d / name)
            weight_map |= dict.fromkeys(part, name)
        index = "model.safetensors.index.json" if kind == "safetensors" else (
            "pytorch_model.bin.index.json")  # fmt: skip
        (d / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        return d

    single_bin = tmp_path / "single-bin"
    single_bin.mkdir()
    (single_bin / "config.json").write_text(config)
    torch.save(tensors, single_bin / "pytorch_model.bin")
    ids = torch.randint(0, 300, (1, 8))
    with torch.no_grad():
        want = hf_model(ids).logits
        for d in (sharded("safetensors"), sharded("bin"), single_bin):
            got = hf_to_llmkit(d).model(ids).logits
            assert (got - want).abs().max() <= 1e-4, d.name


def test_a_pickle_with_code_is_refused(checkpoint, tmp_path, capsys):
    d = tmp_path / "evil"
    d.mkdir()
    (d / "config.json").write_text((checkpoint[0] / "config.json").read_text())
    torch.save({"w": torch.zeros(1), "f": print}, d / "pytorch_model.bin")  # a callable
    err = one_line_error(capsys, ["import-hf", str(d), str(tmp_path / "out")])
    assert "pytorch_model.bin" in err and "weights only" in err


@pytest.mark.parametrize(
    "change",
    [
        {"num_attention_heads": 0},
        {"vocab_size": -5},
        {"num_hidden_layers": "2"},
        {"model_type": ["llama"]},
        {"intermediate_size": 97},  # the weights are 96 wide
    ],
)
def test_a_malformed_config_is_one_line(checkpoint, tmp_path, capsys, change):
    d = tmp_path / "bad"
    d.mkdir()
    config = json.loads((checkpoint[0] / "config.json").read_text()) | change
    (d / "config.json").write_text(json.dumps(config))
    # a copy: a link out of the checkpoint directory would be refused for that alone
    shutil.copy(checkpoint[0] / "model.safetensors", d / "model.safetensors")
    one_line_error(capsys, ["import-hf", str(d), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("config_cls", "base_cls", "causal_cls"), [
    ("GPT2Config", "GPT2Model", "GPT2LMHeadModel"),
    ("OPTConfig", "OPTModel", "OPTForCausalLM"),
    ("LlamaConfig", "LlamaModel", "LlamaForCausalLM"),
])  # fmt: skip
def test_a_base_model_checkpoint_imports(tmp_path, config_cls, base_cls, causal_cls):
    """The hub's GPT-2 files hold the base model's names (wte.weight, h.0...): import adds the
    prefix transformers adds when it loads them into the causal-LM class."""
    import transformers

    from llmkit.interop.convert import hf_to_llmkit

    small = {
        "GPT2Config": dict(n_embd=32, n_layer=2, n_head=4, vocab_size=61, n_positions=32),
        "OPTConfig": dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                          vocab_size=61, max_position_embeddings=32, word_embed_proj_dim=32),
        "LlamaConfig": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, vocab_size=61, tie_word_embeddings=True),
    }[config_cls]  # fmt: skip
    cfg = getattr(transformers, config_cls)(**small)
    torch.manual_seed(0)
    getattr(transformers, base_cls)(cfg).save_pretrained(tmp_path)
    causal = getattr(transformers, causal_cls).from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 61, (1, 9))
    with torch.no_grad():
        gap = (hf_to_llmkit(tmp_path).model(ids).logits - causal(ids).logits).abs().max()
    assert gap <= 1e-4


def test_fine_tuning_keeps_a_tied_padded_vocabulary(tmp_path):
    # A tied pair is stored once (as lm_head.weight): its padded rows are kept all the same.
    src = tmp_path / "tied-llama"
    src.mkdir()
    n = save_tokenizer(src)
    make_hf("LlamaConfig", "LlamaForCausalLM", src, hidden_size=32, intermediate_size=48,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=n + 4, max_position_embeddings=64, tie_word_embeddings=True,
            eos_token_id=0, bos_token_id=1)  # fmt: skip
    run = tmp_path / "imported"
    assert main(["import-hf", str(src), str(run)]) == 0
    out = tmp_path / "ft"
    assert main(["train", str(finetune_spec(tmp_path, run, 1)), "--out", str(out),
                 "--no-progress"]) == 0  # fmt: skip
    assert f"vocab_size: {n + 4}" in (out / "spec.yaml").read_text()
