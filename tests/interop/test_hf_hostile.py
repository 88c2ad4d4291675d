"""``llmkit import-hf`` / ``export-hf`` on hostile or malformed Hugging Face checkpoints.

Every checkpoint here is built by the test, small, in ``tmp_path``. Each refusal must be one
line (exit 2, no traceback), leave the output directory as it was (absent, or empty) with no
temporary directory beside it, and read nothing outside the checkpoint directory; pickles
are read only through the weights-only unpickler and no checkpoint's code is ever run.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmkit.cli.app import main
from llmkit.interop import hf_files
from tests.interop import hf_parity
from tests.interop.hf_parity import make_hf

TEXT = "\n".join(f"def f{i}(x):\n    return x * {i} + {i % 7}" for i in range(100))
SMALL = dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, eos_token_id=0, bos_token_id=1,
)  # fmt: skip
#: A tensor of the checkpoint the tests tamper with.
UP = "model.layers.1.mlp.up_proj.weight"


def save_tokenizer(path: Path) -> int:
    return hf_parity.save_tokenizer(path, TEXT, vocab_size=280)


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint with a tokenizer and a generation config: it imports."""
    src = tmp_path_factory.mktemp("hf") / "tiny-llama"
    src.mkdir()
    n = save_tokenizer(src)
    make_hf("LlamaConfig", "LlamaForCausalLM", src, vocab_size=n + 4, **SMALL)
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    if not (src / "special_tokens_map.json").is_file():  # transformers 5 writes none
        (src / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return src


@pytest.fixture(scope="module")
def good_run(good, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "imported"
    assert main(["import-hf", str(good), str(out)]) == 0
    return out


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def refused(capsys, argv: list[str]) -> str:
    """Run the CLI: exit 2, one line on stderr, no traceback; the line."""
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def untouched(out: Path, *, existed: bool = False) -> None:
    """``out`` as it was (absent, or an empty directory) and no temporary beside it."""
    if existed:
        assert out.is_dir() and not any(out.iterdir())
    else:
        assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.*")), "a temporary directory was left"


def edit_config(d: Path, **change) -> None:
    config = json.loads((d / "config.json").read_text()) | change
    (d / "config.json").write_text(json.dumps(config))


def shard(d: Path, outside: Path | None = None) -> dict[str, str]:
    """Split ``d``'s model.safetensors into two shards and an index (the second shard in
    ``outside`` when given); the weight map."""
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :]), 1):
        name = f"model-0000{i}-of-00002.safetensors"
        where = outside if (outside is not None and i == 2) else d
        save_file({k: tensors[k] for k in part}, str(where / name))
        weight_map |= dict.fromkeys(part, name)
    write_index(d, weight_map)
    return weight_map


def write_index(d: Path, weight_map, metadata=None) -> None:
    index = {"metadata": metadata if metadata is not None else {}, "weight_map": weight_map}
    (d / hf_files.SAFETENSORS_INDEX).write_text(json.dumps(index))


def set_tensor(path: Path, name: str, change) -> None:
    tensors = load_file(str(path))
    tensors[name] = change(tensors[name])
    save_file(tensors, str(path), {"format": "pt"})


@pytest.fixture
def no_real_build(monkeypatch):
    """Fail the test if the model is built for real (off the meta device): the checks
    must come first, and a test of an unchecked bomb must not allocate it."""
    import llmkit.model

    real = llmkit.model.build_model

    def guarded(rs):
        if torch.empty(0).device.type != "meta":
            raise AssertionError("the model was built for real before the checkpoint's checks")
        return real(rs)

    monkeypatch.setattr(llmkit.model, "build_model", guarded)


# -- 1. nothing outside the checkpoint is read --------------------------------------------


@pytest.mark.parametrize("how", ["absolute", "climbing"])
def test_a_shard_index_entry_outside_the_checkpoint_is_refused(good, tmp_path, capsys, how):
    d = copy(good, tmp_path / "ckpt")
    outside = tmp_path / "outside"
    outside.mkdir()
    weight_map = shard(d, outside)
    second = "model-00002-of-00002.safetensors"
    entry = str(outside / second) if how == "absolute" else f"../outside/{second}"
    write_index(d, {k: (entry if v == second else v) for k, v in weight_map.items()})
    out = tmp_path / "run"
    err = refused(capsys, ["import-hf", str(d), str(out)])
    assert entry in err and "model.safetensors.index.json" in err
    assert ("absolute" in err) if how == "absolute" else ("outside the checkpoint" in err)
    untouched(out)


@pytest.mark.parametrize(
    "name", ["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
             "generation_config.json", "special_tokens_map.json"],
)  # fmt: skip
def test_a_file_linking_outside_the_checkpoint_is_refused(good, tmp_path, capsys, name):
    d = copy(good, tmp_path / "ckpt")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(d / name, outside / name)  # a valid file: following the link would work
    (d / name).symlink_to(outside / name)
    out = tmp_path / "run"
    err = refused(capsys, ["import-hf", str(d), str(out)])
    assert name in err and "outside the checkpoint" in err
    untouched(out)


def test_a_shard_linking_outside_the_checkpoint_is_refused(good, tmp_path, capsys):
    d = copy(good, tmp_path / "ckpt")
    outside = tmp_path / "outside"
    outside.mkdir()
    shard(d, outside)
    (d / "model-00002-of-00002.safetensors").symlink_to(
        outside / "model-00002-of-00002.safetensors"
    )
    err = refused(capsys, ["import-hf", str(d), str(tmp_path / "run")])
    assert "model-00002-of-00002.safetensors" in err and "outside the checkpoint" in err
    untouched(tmp_path / "run")


def legacy_tokenizer(d: Path) -> None:
    """Replace tokenizer.json by GPT-2's legacy vocab.json + merges.txt (transformers
    converts them, opening the files it finds by itself)."""
    from tokenizers import Tokenizer

    Tokenizer.from_file(str(d / "tokenizer.json")).model.save(str(d))
    (d / "tokenizer.json").unlink()


def test_legacy_tokenizer_files_outside_the_checkpoint_are_refused(good, tmp_path, capsys):
    d = copy(good, tmp_path / "ckpt")
    legacy_tokenizer(d)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(d / "merges.txt", outside / "merges.txt")
    (d / "merges.txt").symlink_to(outside / "merges.txt")
    err = refused(capsys, ["import-hf", str(d), str(tmp_path / "run")])
    assert "merges.txt" in err and "outside the checkpoint" in err
    (d / "merges.txt").unlink()
    shutil.copy(outside / "merges.txt", d / "merges.txt")
    # tokenizer_config.json naming a vocabulary file elsewhere (older transformers open it)
    config = json.loads((d / "tokenizer_config.json").read_text())
    shutil.copy(d / "vocab.json", outside / "vocab.json")
    config["vocab_file"] = str(outside / "vocab.json")
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    err = refused(capsys, ["import-hf", str(d), str(tmp_path / "run")])
    assert "vocab_file" in err and "absolute path" in err
    del config["vocab_file"]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    assert main(["import-hf", str(d), str(tmp_path / "run")]) == 0


def test_links_inside_the_checkpoint_and_a_cache_snapshot_import(good, tmp_path):
    """Links that stay inside are followed; a Hugging Face cache snapshot's links into its
    repository's blobs are too."""
    d = copy(good, tmp_path / "ckpt")
    (d / "weights").mkdir()
    shutil.move(d / "model.safetensors", d / "weights" / "real.safetensors")
    (d / "model.safetensors").symlink_to(Path("weights") / "real.safetensors")
    assert main(["import-hf", str(d), str(tmp_path / "run")]) == 0
    repo = tmp_path / "hub" / "models--tiny--llama"
    snapshot, blobs = repo / "snapshots" / "0123abcd", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(p for p in good.iterdir() if p.is_file())):
        shutil.copy(f, blobs / f"blob{i}")
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / f"blob{i}")
    assert main(["import-hf", str(snapshot), str(tmp_path / "run2")]) == 0


# -- 2. nothing half-written ---------------------------------------------------------------


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", "[" * 100_000 + "]" * 100_000])
def test_a_bad_generation_config_leaves_no_run(good, tmp_path, capsys, content):
    d = copy(good, tmp_path / "ckpt")
    (d / "generation_config.json").write_text(content)
    out = tmp_path / "run"
    err = refused(capsys, ["import-hf", str(d), str(out)])
    assert "generation_config.json" in err
    untouched(out)
    (d / "generation_config.json").write_text("{}")
    assert main(["import-hf", str(d), str(out)]) == 0  # the next import works


def test_a_failed_import_keeps_an_empty_output_and_makes_no_parents(good, tmp_path, capsys):
    d = copy(good, tmp_path / "ckpt")
    (d / "generation_config.json").write_text("{not json")
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(capsys, ["import-hf", str(d), str(empty)])
    untouched(empty, existed=True)
    nested = tmp_path / "a" / "b" / "run"
    refused(capsys, ["import-hf", str(d), str(nested)])
    assert not (tmp_path / "a").exists()
    (d / "generation_config.json").write_text("{}")
    assert main(["import-hf", str(d), str(empty)]) == 0
    assert (empty / "spec.yaml").is_file() and (empty / "hf_source.json").is_file()


@pytest.mark.parametrize(
    "content", ['{"pad_token": 5}', '{"unk_token": ["x"]}', "[" * 100_000 + "]" * 100_000]
)
def test_a_bad_run_tokenizer_config_leaves_no_export(good_run, tmp_path, capsys, content):
    run = copy(good_run, tmp_path / "run")
    (run / "tokenizer_config.json").write_text(content)
    out = tmp_path / "exported"
    err = refused(capsys, ["export-hf", str(run), str(out)])
    assert "tokenizer_config.json" in err
    untouched(out)
    out.mkdir()
    refused(capsys, ["export-hf", str(run), str(out)])
    untouched(out, existed=True)
    shutil.copy(good_run / "tokenizer_config.json", run / "tokenizer_config.json")
    assert main(["export-hf", str(run), str(out)]) == 0
    assert (out / "tokenizer.json").is_file() and (out / "model.safetensors").is_file()


def test_a_bad_hf_source_leaves_no_export(good_run, tmp_path, capsys):
    run = copy(good_run, tmp_path / "run")
    source = json.loads((run / "hf_source.json").read_text())
    (run / "hf_source.json").write_text(json.dumps(source | {"generation_config": [1]}))
    err = refused(capsys, ["export-hf", str(run), str(tmp_path / "out")])
    assert "hf_source.json" in err and "generation_config" in err
    untouched(tmp_path / "out")


# -- 3. shapes and sizes checked on the meta device before any allocation -------------------


@pytest.mark.parametrize(
    ("change", "tensor"),
    [
        ({"hidden_size": 1024, "intermediate_size": 4096}, "model.embed_tokens.weight"),
        ({"intermediate_size": 4096}, "model.layers.0.mlp.gate_proj.weight"),
        ({"vocab_size": 1 << 24}, "model.embed_tokens.weight"),  # the spec's largest
    ],
)
def test_a_config_larger_than_its_weights_is_refused_before_allocating(
    good, tmp_path, capsys, no_real_build, change, tensor
):
    d = copy(good, tmp_path / "ckpt")
    edit_config(d, **change)
    found = tuple(load_file(str(d / "model.safetensors"))[tensor].shape)
    err = refused(capsys, ["import-hf", str(d), str(tmp_path / "run")])
    assert tensor in err and str(found) in err and "expects" in err
    untouched(tmp_path / "run")


def test_an_absurd_context_is_refused_before_allocating(tmp_path, capsys, no_real_build):
    """RoPE tables sized by max_position_embeddings × head_dim: no tensor of the checkpoint
    has that shape, so the model's size against the checkpoint's catches it (here 2^20
    positions × 2048 dims, 17 GB of tables and a float64 temporary as large, for a
    checkpoint of 0.6 MB)."""
    d = tmp_path / "ckpt"
    make_hf("LlamaConfig", "LlamaForCausalLM", d, hidden_size=16, intermediate_size=16,
            num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=2048,
            vocab_size=64, max_position_embeddings=64)  # fmt: skip
    edit_config(d, max_position_embeddings=1 << 20)  # the spec's largest context
    err = refused(capsys, ["import-hf", str(d), str(tmp_path / "run")])
    assert "position.cos_cached" in err and "far more than its weights" in err
    untouched(tmp_path / "run")


def test_a_layer_count_beyond_the_tensors_is_refused_before_the_spec(
    good, tmp_path, capsys, monkeypatch
):
    from llmkit.interop import convert

    real = convert.model_table

    def guarded(cfg, *args, **kwargs):
        if cfg.get("num_hidden_layers", 0) > 1000:
            raise AssertionError("the family read a config with 10 million layers")
        return real(cfg, *args, **kwargs)

    monkeypatch.setattr(convert, "model_table", guarded)
    d = copy(good, tmp_path / "ckpt")
    edit_config(d, num_hidden_layers=10_000_000)
    err = refused(capsys, ["import-hf", str(d), str(tmp_path / "run")])
    assert "num_hidden_layers = 10000000" in err and "tensors" in err


def test_integer_weights_are_refused(good, tmp_path, capsys):
    d = copy(good, tmp_path / "ckpt")
    set_tensor(d / "model.safetensors", UP, lambda t: (t * 100).to(torch.int64))
    err = refused(capsys, ["import-hf", str(d), str(tmp_path / "run")])
    assert UP in err and "int64" in err


# -- 4. inconsistent inputs ---------------------------------------------------------------


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path, capsys):
    d = tmp_path / "ckpt"
    d.mkdir()
    n = save_tokenizer(d)
    make_hf("LlamaConfig", "LlamaForCausalLM", d, vocab_size=n - 8, **SMALL)
    err = refused(capsys, ["import-hf", str(d), str(tmp_path / "run")])
    assert f"{n} ids" in err and f"vocab_size {n - 8}" in err
    untouched(tmp_path / "run")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_nonfinite_weight_is_refused_on_import(good, tmp_path, capsys, value):
    d = copy(good, tmp_path / "ckpt")

    def poison(t):
        t = t.clone()
        t[3, 5] = value
        return t

    set_tensor(d / "model.safetensors", UP, poison)
    err = refused(capsys, ["import-hf", str(d), str(tmp_path / "run")])
    assert UP in err and "NaN or infinite" in err
    untouched(tmp_path / "run")


def test_a_nonfinite_or_overflowing_weight_is_refused_on_export(good_run, tmp_path, capsys):
    run = copy(good_run, tmp_path / "run")
    ours = "layers.1.ffn.up_proj.weight"
    assert ours in load_file(str(run / "model.safetensors"))

    def change(value):
        def f(t):
            t = t.clone()
            t[2, 3] = value
            return t

        return f

    set_tensor(run / "model.safetensors", ours, change(float("nan")))
    err = refused(capsys, ["export-hf", str(run), str(tmp_path / "out")])
    assert UP in err and "NaN or infinite" in err
    untouched(tmp_path / "out")
    set_tensor(run / "model.safetensors", ours, change(1e6))  # finite, beyond float16
    err = refused(capsys, ["export-hf", "--dtype", "float16", str(run), str(tmp_path / "out")])
    assert UP in err and "float16" in err
    untouched(tmp_path / "out")
    assert main(["export-hf", "--dtype", "float32", str(run), str(tmp_path / "out")]) == 0


def test_a_tensor_in_two_shards_is_refused(good, tmp_path, capsys):
    d = copy(good, tmp_path / "ckpt")
    weight_map = shard(d)
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    name = next(k for k, v in weight_map.items() if v == first)
    tensors = load_file(str(d / second))
    tensors[name] = load_file(str(d / first))[name] * 2  # the later shard's would win
    save_file(tensors, str(d / second))
    err = refused(capsys, ["import-hf", str(d), str(tmp_path / "run")])
    assert name in err and first in err and second in err
    untouched(tmp_path / "run")


def test_an_index_naming_a_tensor_in_the_wrong_shard_is_refused(good, tmp_path, capsys):
    d = copy(good, tmp_path / "ckpt")
    weight_map = shard(d)
    name = next(k for k, v in weight_map.items() if v.startswith("model-00001"))
    write_index(d, weight_map | {name: "model-00002-of-00002.safetensors"})
    err = refused(capsys, ["import-hf", str(d), str(tmp_path / "run")])
    assert name in err


def test_wrongly_typed_token_ids_are_refused(good, tmp_path, capsys):
    d = copy(good, tmp_path / "ckpt")
    edit_config(d, eos_token_id={"id": 0})
    err = refused(capsys, ["import-hf", str(d), str(tmp_path / "run")])
    assert "eos_token_id" in err
    edit_config(d, eos_token_id=[0, 1])  # a list, as Llama 3's, is fine
    assert main(["import-hf", str(d), str(tmp_path / "run")]) == 0


# -- 5. one line, not a traceback -----------------------------------------------------------

DEEP_UNPARSEABLE = "[" * 100_000 + "]" * 100_000
DEEP_PARSEABLE = '{"a": ' * 300 + "1" + "}" * 300


@pytest.mark.parametrize(
    "name",
    ["config.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
     "model.safetensors.index.json"],
)  # fmt: skip
@pytest.mark.parametrize("deep", [DEEP_UNPARSEABLE, DEEP_PARSEABLE], ids=["100k", "300"])
def test_deeply_nested_json_is_one_line(good, tmp_path, capsys, name, deep):
    d = copy(good, tmp_path / "ckpt")
    if name == "model.safetensors.index.json":
        shard(d)
    if deep is DEEP_PARSEABLE and name == "config.json":
        edit_config(d, extra=json.loads(deep))  # a valid config with a deep value
    else:
        (d / name).write_text(deep)
    err = refused(capsys, ["import-hf", str(d), str(tmp_path / "run")])
    assert name in err and ("nested" in err or "JSON" in err)
    untouched(tmp_path / "run")


FIRST = "model-00001-of-00002.safetensors"


@pytest.mark.parametrize(
    "index",
    [
        lambda wm: [],
        lambda wm: {"weight_map": []},
        lambda wm: {"weight_map": {}},
        lambda wm: {"weight_map": FIRST},
        lambda wm: {"weight_map": wm | {UP: 1}},
        lambda wm: {"weight_map": wm | {UP: [wm[UP]]}},
        lambda wm: {"weight_map": wm | {UP: None}},
        lambda wm: {"weight_map": wm | {UP: {"file": wm[UP]}}},
        lambda wm: {"weight_map": wm | {UP: ""}},
        lambda wm: {"weight_map": wm | {UP: "."}},
        lambda wm: {"metadata": "big", "weight_map": wm},
        lambda wm: {"metadata": [1], "weight_map": wm},
        lambda wm: {"metadata": {"total_size": "1GB"}, "weight_map": wm},
        lambda wm: {"metadata": {"total_size": -1}, "weight_map": wm},
    ],
)
def test_a_wrongly_typed_shard_index_is_one_line(good, tmp_path, capsys, index):
    d = copy(good, tmp_path / "ckpt")
    weight_map = shard(d)
    (d / hf_files.SAFETENSORS_INDEX).write_text(json.dumps(index(weight_map)))
    err = refused(capsys, ["import-hf", str(d), str(tmp_path / "run")])
    assert "model.safetensors.index.json" in err
    untouched(tmp_path / "run")


# -- pickles and remote code -----------------------------------------------------------------


class Payload:
    """Pickled, it calls ``os.system`` when unpickled by a full unpickler."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickles_are_read_weights_only_or_not_at_all(good, tmp_path, capsys, monkeypatch):
    d = copy(good, tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    torch.save({**tensors, "x": Payload(marker)}, d / "pytorch_model.bin")
    err = refused(capsys, ["import-hf", str(d), str(tmp_path / "run")])
    assert "pytorch_model.bin" in err and "weights only" in err
    assert not marker.exists()
    # other pickles (.pt, .pth, .ckpt) are never opened
    (d / "pytorch_model.bin").rename(d / "model.pt")
    torch.save(tensors, d / "consolidated.pth")

    def no_load(*args, **kwargs):
        raise AssertionError("torch.load was called")

    monkeypatch.setattr(torch, "load", no_load)
    err = refused(capsys, ["import-hf", str(d), str(tmp_path / "run")])
    assert "no weights" in err and "never read" in err
    assert not marker.exists()


def evil_code(d: Path, marker: Path, *names: str) -> None:
    for name in names:
        (d / name).write_text(
            f"from pathlib import Path\nPath({str(marker)!r}).write_text({name!r})\n"
            "raise SystemExit('checkpoint code ran')\n"
        )


def test_auto_map_code_is_never_run(good, tmp_path, capsys):
    d = copy(good, tmp_path / "ckpt")
    marker = tmp_path / "ran"
    evil_code(d, marker, "configuration_evil.py", "modeling_evil.py", "tokenization_evil.py")
    edit_config(
        d,
        auto_map={
            "AutoConfig": "configuration_evil.EvilConfig",
            "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
            "AutoTokenizer": ["tokenization_evil.EvilTokenizer", None],
        },
    )
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    config["tokenizer_class"] = "EvilTokenizer"
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    assert main(["import-hf", str(d), str(tmp_path / "run")]) == 0
    assert not marker.exists()
    legacy_tokenizer(d)  # transformers converts these: still with trust_remote_code=False
    code = main(["import-hf", str(d), str(tmp_path / "run2")])
    err = capsys.readouterr().err.strip()
    assert code == 0 or (code == 2 and len(err.splitlines()) == 1), err
    assert not marker.exists()


def test_an_llmkit_remote_code_checkpoint_imports_without_its_code(tmp_path):
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
    out = tmp_path / "exported"
    assert main(["export-hf", str(run), str(out)]) == 0
    assert (out / "modeling_llmkit.py").is_file()
    marker = tmp_path / "ran"
    evil_code(out, marker, "modeling_llmkit.py", "configuration_llmkit.py")
    assert main(["import-hf", str(out), str(tmp_path / "back")]) == 0
    assert not marker.exists()
