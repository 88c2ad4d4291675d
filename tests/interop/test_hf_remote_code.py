"""Remote-code export: a model no native family holds (the README's demo architecture,
specs/tiny.toml) goes out with llmkit's own ``modeling_llmkit.py``, and transformers loads it
with ``trust_remote_code=True`` into the same logits and greedy tokens as llmkit; what a
native family holds still goes out natively; import reads the export back; every shipped spec
exports one way or the other (the table in docs/interop.md)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmkit.cli.app import main
from llmkit.interop import hf_files
from llmkit.interop.remote_code import DIRECTORY, FILES

ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "specs"
DOC = ROOT / "docs" / "interop.md"
LOADER = Path(__file__).with_name("remote_loader.py")
TEXT = "\n".join(f"def f{i}(x):\n    return x * {i} + {i % 7}" for i in range(60))
#: The demo's components (specs/tiny.toml) at test size; a wide init so greedy tokens vary.
SMALL = (
    "d_model = 32\nn_layers = 2\nn_heads = 4\nmax_seq_len = 64\ninit_std = 0.5\n"
    "scaled_residual_init = false\n"
)

pytestmark = pytest.mark.usefixtures("one_thread")


def load_model(run: Path):
    from llmkit.runs import build_run_model, open_run
    from llmkit.runs.checkpoints import load_weights

    found = open_run(run)
    model, _ = build_run_model(found.resolve(), load_base=False)
    load_weights(model, found.weights())
    return model.eval()


def llmkit_greedy(model, prompt: list[int], n: int) -> list[int]:
    from llmkit.inference import Generator

    out = Generator(model).generate([prompt], temperature=0, max_new_tokens=n, ignore_eos=True)
    return out[0].ids


def load_in_subprocess(tmp: Path, dirs: list[str], **env: str) -> dict:
    """:mod:`remote_loader` in a fresh process: remote code copied to a throwaway cache."""
    result = tmp / "loaded.pt"
    environ = os.environ | {
        "HF_MODULES_CACHE": str(tmp / "hf-modules"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [sys.executable, str(LOADER), str(result), *dirs],
        env=environ | env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(result, weights_only=False)


def save_run(tmp: Path, name: str, model_table: dict):
    from llmkit.model import build_model
    from llmkit.runs import save_spec
    from llmkit.runs.checkpoints import save_weights
    from llmkit.spec import resolve

    rs = resolve({"name": name, "model": model_table})
    torch.manual_seed(0)
    model = build_model(rs).eval()
    run = tmp / name
    run.mkdir()
    save_spec(rs, run)
    save_weights(model, run / "model.safetensors")
    return run, model


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> Path:
    """Two training steps of specs/tiny.toml's architecture at test size (a char tokenizer on
    a small text)."""
    from llmkit.training import train

    tmp = tmp_path_factory.mktemp("demo")
    corpus = tmp / "corpus.txt"
    corpus.write_text(TEXT)
    spec = tmp / "demo.toml"
    spec.write_text(
        f'extends = "{SPECS / "tiny.toml"}"\n[model]\n{SMALL}'
        '[tokenizer]\nkind = "char"\n'
        f'[data]\nsource = {{ name = "text", paths = ["{corpus}"] }}\nblock_size = 32\n'
        "[train]\nmax_steps = 2\nbatch_size = 2\neval_interval = 2\neval_batches = 1\n"
        "sample_tokens = 0\nplot = false\n"
        '[schedule]\nname = "constant"\n'
    )
    run = tmp / "tiny-demo"
    train(spec, run_dir=run, overrides=[], log=lambda _: None, progress=False)
    return run


@pytest.fixture(scope="module")
def demo_export(demo_run, tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("exports") / "demo-export"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["export-hf", str(demo_run), str(out)]) == 0
    return out, buf.getvalue()


def test_the_demo_architecture_is_the_demo_spec(demo_run):
    from llmkit.spec import load_spec

    tiny = load_spec(SPECS / "tiny.toml").to_dict()["model"]
    ours = json.loads((demo_run / "resolved.json").read_text())["model"]
    for key in ("attention", "ffn", "norm", "position", "block", "bias", "tie_embeddings"):
        assert ours[key] == tiny[key], key


def test_demo_exports_as_remote_code(demo_run, demo_export):
    out, printed = demo_export
    assert "as remote code" in printed and "modeling_llmkit.py" in printed
    for name in FILES:  # our own template, byte for byte
        assert (out / name).read_bytes() == (DIRECTORY / name).read_bytes()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llmkit" and cfg["architectures"] == ["LlmkitForCausalLM"]
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_llmkit.LlmkitForCausalLM"
    assert cfg["llmkit_requires"] == {"llmkit": "0.1.0"}
    from llmkit.runs import open_run
    from llmkit.spec import resolve

    saved = open_run(demo_run).resolve().to_dict()["model"]  # the run's spec, as it resolves
    assert resolve(cfg["llmkit_spec"]).to_dict()["model"] == saved
    assert (out / "tokenizer.json").is_file()
    tensors = hf_files.read_weights(out)
    state = load_model(demo_run).state_dict()
    assert "model.lm_head.weight" not in tensors  # tied: stored once
    assert all(
        torch.equal(tensors["model." + k], v) for k, v in state.items() if "lm_head" not in k
    )


@pytest.fixture(scope="module")
def plugin_export(tmp_path_factory):
    """A model with llmkit-extras' components (norm, q/k transform), exported with the
    plugin loaded: (directory, model); None where the plugin is not installed."""
    try:
        import llmkit_extras  # noqa: F401
    except ImportError:
        yield None
        return
    from llmkit.interop.runs import export_hf
    from llmkit.registry import reset_registry

    tmp = tmp_path_factory.mktemp("plugin")
    saved = os.environ.get("LLMKIT_PLUGINS")
    os.environ["LLMKIT_PLUGINS"] = "extras"
    reset_registry()
    try:
        table = {
            "vocab_size": 61, "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 64,
            "norm": {"name": "dyt"}, "qk_transform": {"name": "qk_norm"},
            "position": {"name": "alibi"}, "init_std": 0.5,
        }  # fmt: skip
        run, model = save_run(tmp, "with-plugins", table)
        out = tmp / "plugin-export"
        done = export_hf(run, out)
        assert done.remote_code and done.model_type == "llmkit"
        yield out, model
    finally:
        if saved is None:
            os.environ.pop("LLMKIT_PLUGINS", None)
        else:
            os.environ["LLMKIT_PLUGINS"] = saved
        reset_registry()


@pytest.fixture(scope="module")
def loaded(demo_export, plugin_export, tmp_path_factory) -> dict:
    """Both exports loaded in one fresh process, plugins allowed."""
    dirs = [str(demo_export[0])] + ([str(plugin_export[0])] if plugin_export else [])
    return load_in_subprocess(tmp_path_factory.mktemp("load"), dirs, LLMKIT_PLUGINS="extras")


@pytest.fixture(scope="module")
def refused(demo_export, plugin_export, tmp_path_factory) -> dict:
    """In one fresh process: the plugin's export without the plugin, then the demo's export
    where llmkit cannot be imported."""
    dirs = ([str(plugin_export[0])] if plugin_export else []) + ["--no-llmkit"]
    dirs.append(str(demo_export[0]))
    return load_in_subprocess(tmp_path_factory.mktemp("refuse"), dirs, LLMKIT_PLUGINS="")


def test_transformers_loads_the_export_with_trust_remote_code(demo_run, demo_export, loaded):
    """In a fresh process, as a user loads it: the logits (left-padded too) and the greedy
    tokens (with and without the KV cache) are llmkit's."""
    got = loaded[str(demo_export[0])]
    assert "error" not in got, got.get("error")
    assert got["class"] == "LlmkitForCausalLM"
    model = load_model(demo_run)
    with torch.no_grad():
        want = model(got["ids"]).logits
        padded = model(got["ids"], key_padding_mask=got["mask"].bool()).logits
    assert (got["logits"] - want).abs().max().item() <= 1e-5
    real = got["mask"].bool()
    assert (got["padded"][real] - padded[real]).abs().max().item() <= 1e-5
    greedy = llmkit_greedy(model, got["prompt"], 6)
    assert len(set(greedy)) > 1  # a test that can fail
    assert got["greedy"][True] == greedy and got["greedy"][False] == greedy


def test_the_remote_code_says_llmkit_is_missing(demo_export, refused):
    """Where llmkit cannot be imported, loading is an ImportError saying what to install."""
    error = refused[str(demo_export[0])]["error"]
    assert error.startswith("ImportError: this checkpoint is an llmkit model")
    assert "needs the llmkit package installed" in error


def test_plugin_components_export_and_need_their_plugin(plugin_export, loaded, refused):
    if plugin_export is None:
        pytest.skip("llmkit-extras is not installed")
    out, model = plugin_export
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["llmkit_requires"] == {"llmkit": "0.1.0", "llmkit-extras": "0.1.0"}
    got = loaded[str(out)]
    with torch.no_grad():
        assert (got["logits"] - model(got["ids"]).logits).abs().max().item() <= 1e-5
    error = refused[str(out)]["error"]
    assert error.startswith("ImportError: this llmkit model needs components")
    assert "llmkit-extras 0.1.0" in error and "unknown norm 'dyt'" in error


def test_a_native_family_still_exports_natively(tmp_path, capsys):
    table = {
        "vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "bias": False,
        "position": {"name": "rope"}, "norm": {"name": "rmsnorm"}, "ffn": {"name": "swiglu"},
    }  # fmt: skip
    run, _ = save_run(tmp_path, "llama-like", table)
    out = tmp_path / "out"
    assert main(["export-hf", str(run), str(out)]) == 0
    assert "as native family llama (LlamaForCausalLM)" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert not any((out / name).exists() for name in FILES)


def test_in_memory_wrapper_forward_loss_and_generate(tmp_path):
    """``to_transformers(remote_code=True)``: the wrapper from the package's template, in this
    process: logits, the shifted loss, left padding, greedy with and without the cache."""
    import torch.nn.functional as F

    from llmkit.errors import LlmkitError
    from llmkit.interop import to_transformers
    from llmkit.model import build_model
    from llmkit.spec import resolve

    table = {
        "vocab_size": 53, "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 64,
        "bias": False, "position": {"name": "rope"}, "ffn": {"name": "mlp"},
        "norm": {"name": "layernorm"}, "init_std": 0.5, "scaled_residual_init": False,
    }  # fmt: skip
    torch.manual_seed(1)
    model = build_model(resolve({"model": table})).eval()
    with pytest.raises(LlmkitError, match="no Hugging Face architecture"):
        to_transformers(model)
    hf = to_transformers(model, remote_code=True)
    assert type(hf).__name__ == "LlmkitForCausalLM"
    ids = torch.randint(0, 53, (2, 10))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with torch.no_grad():
        out = hf(ids, labels=ids)
        assert torch.equal(out.logits, model(ids).logits)
        want = F.cross_entropy(out.logits[:, :-1].reshape(-1, 53), ids[:, 1:].reshape(-1))
        assert torch.allclose(out.loss, want)
        padded = hf(ids, attention_mask=mask).logits
        ours = model(ids, key_padding_mask=mask.bool()).logits
        assert torch.equal(padded[mask.bool()], ours[mask.bool()])
    prompt = ids[:1, :4]
    greedy = llmkit_greedy(model, prompt[0].tolist(), 8)
    for cache in (True, False):
        got = hf.generate(
            prompt, max_new_tokens=8, do_sample=False, use_cache=cache, pad_token_id=0
        )
        assert got[0, 4:].tolist() == greedy, cache
    # a left-padded batch, and beam search (which reorders llmkit's cache): the same tokens
    # through the cache as recomputed
    for beams in (1, 3):
        runs = [
            hf.generate(
                ids[:, :6], attention_mask=mask[:, :6], max_new_tokens=5, num_beams=beams,
                do_sample=False, use_cache=cache, pad_token_id=0,
            )
            for cache in (True, False)
        ]  # fmt: skip
        assert torch.equal(runs[0], runs[1]), beams


def test_import_reads_a_remote_code_export_back(demo_run, demo_export, tmp_path, capsys):
    out, _ = demo_export
    run = tmp_path / "back"
    assert main(["import-hf", str(out), str(run)]) == 0
    assert "imported llmkit" in capsys.readouterr().out
    again = tmp_path / "again"
    assert main(["export-hf", str(run), str(again)]) == 0
    assert "as remote code" in capsys.readouterr().out
    first, second = hf_files.read_weights(out), hf_files.read_weights(again)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    back, original = load_model(run), load_model(demo_run)
    ids = torch.randint(0, original.config.vocab_size, (2, 7))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, original(ids).logits)


# -- every shipped spec exports, natively or as remote code ----------------------------------


def shipped_specs() -> list[Path]:
    return sorted(p for p in SPECS.rglob("*") if p.suffix in (".toml", ".yaml", ".yml"))


def export_path(path: Path) -> str:
    """How ``llmkit export-hf`` writes a run of this spec: the decision alone (the spec's
    resolved model; weights are not needed), and for remote code the saved spec is checked
    to resolve back to the same model."""
    from llmkit.errors import LlmkitError
    from llmkit.interop.convert import _comparable, hf_config_for
    from llmkit.interop.remote import remote_config
    from llmkit.spec import load_spec, resolve

    rs = load_spec(path)
    try:
        _, cfg = hf_config_for(rs)
    except LlmkitError:
        back = resolve(remote_config(rs)["llmkit_spec"])
        assert _comparable(back) == _comparable(rs), path
        return "remote code"
    return f"native `{cfg['model_type']}`"


def paths_table() -> str:
    rows = [f"| `{p.relative_to(ROOT).as_posix()}` | {export_path(p)} |" for p in shipped_specs()]
    return "\n".join(["| spec | `llmkit export-hf` writes |", "|---|---|", *rows])


def test_every_shipped_spec_exports_and_the_docs_say_how():
    table = paths_table()
    assert "remote code" in table and "native" in table
    doc = DOC.read_text()
    begin, end = "<!-- export-paths: begin -->\n", "<!-- export-paths: end -->"
    documented = doc.split(begin, 1)[1].split(end, 1)[0].strip()
    assert documented == table, f"docs/interop.md's table should read:\n{table}"
    assert "`specs/tiny.toml` | remote code" in table
