"""Spec files: structure, two-pass validation, extends, presets, --set, layer overrides."""

from __future__ import annotations

import textwrap

import pytest

from llmkit import hookimpl
from llmkit.errors import LlmkitError, SpecError
from llmkit.spec import load_spec, load_spec_dict, merge, parse_value, select_layers
from tests.conftest import SPECS
from tests.helpers import registry_with, tiny_spec


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_every_example_spec_validates():
    files = sorted(SPECS.glob("*.toml")) + sorted(SPECS.glob("*.yaml"))
    assert {f.name for f in files} >= {
        "tiny.toml",
        "gpt2-small.toml",
        "llama-style.toml",
        "mistral-style.toml",
    }
    for path in files:
        rs = load_spec(path)
        assert len(rs.layers) == rs.model.n_layers


def test_toml_and_yaml_give_the_same_spec(tmp_path):
    toml = write(
        tmp_path,
        "a.toml",
        """
        [model]
        d_model = 32
        n_layers = 2
        n_heads = 4
        attention = { name = "sliding_window", window = 8 }
    """,
    )
    yaml = write(
        tmp_path,
        "a.yaml",
        """
        model:
          d_model: 32
          n_layers: 2
          n_heads: 4
          attention: {name: sliding_window, window: 8}
    """,
    )
    assert load_spec(toml).to_dict() == load_spec(yaml).to_dict()


def test_component_options_are_validated_with_the_full_path_and_file(tmp_path):
    path = write(
        tmp_path,
        "bad.toml",
        """
        [model]
        d_model = 32
        n_layers = 2
        n_heads = 4
        attention = { name = "sliding_window", windw = 8 }
    """,
    )
    with pytest.raises(SpecError) as err:
        load_spec(path)
    msg = str(err.value)
    assert str(path) in msg
    assert "model.attention.windw: unknown option for attention 'sliding_window'" in msg
    assert "did you mean 'window'" in msg


def test_all_errors_are_reported_at_once():
    spec = tiny_spec(
        d_model=-1,
        attention={"name": "sliding_window", "window": 0},
        ffn={"name": "mlp", "activation": "tanh"},
        norm={"name": "rmsnrm"},
    )
    spec["optimizer"] = {"name": "adamw", "lr": -1}
    spec["bogus"] = 1
    with pytest.raises(SpecError) as err:
        load_spec_dict(spec)
    problems = err.value.problems
    paths = [p.split(":")[0] for p in problems]
    assert set(paths) >= {
        "model.d_model",
        "model.attention.window",
        "model.ffn.activation",
        "model.norm.name",
        "optimizer.lr",
        "bogus",
    }
    assert any("did you mean 'rmsnorm'" in p for p in problems)


def test_unknown_key_in_model_suggests_the_field():
    with pytest.raises(SpecError, match=r"model.n_layer: unknown key; did you mean 'n_layers'"):
        load_spec_dict({"model": {"d_model": 8, "n_layer": 2, "n_layers": 2, "n_heads": 2}})


def test_heads_must_divide():
    with pytest.raises(SpecError, match=r"n_heads \(4\) must be a multiple of n_kv_heads \(3\)"):
        load_spec_dict(tiny_spec(n_kv_heads=3))
    with pytest.raises(SpecError, match="divisible by n_heads"):
        load_spec_dict(tiny_spec(d_model=30))
    rs = load_spec_dict(tiny_spec(d_model=30, head_dim=8))
    assert rs.model.dim_head == 8


def test_defaults_are_filled_in_the_resolved_spec():
    rs = load_spec_dict({"model": {"d_model": 32, "n_layers": 1, "n_heads": 4}})
    out = rs.to_dict()
    assert out["model"]["attention"]["name"] == "sdpa"
    assert out["model"]["n_kv_heads"] == 4 and out["model"]["head_dim"] == 8
    assert out["optimizer"]["name"] == "adamw" and "lr" in out["optimizer"]
    assert out["schedule"]["name"] == "cosine"


def test_per_layer_overrides_by_stride_range_and_list():
    spec = tiny_spec(n_layers=6)
    spec["model"]["overrides"] = [
        {"layers": "::2", "attention": {"name": "sliding_window", "window": 4}},
        {"layers": "2:", "ffn": {"name": "swiglu"}},
        {"layers": [-1], "norm": {"name": "rmsnorm"}},
    ]
    layers = load_spec_dict(spec).to_dict()["model"]["layers"]
    assert [layer["attention"]["name"] for layer in layers] == ["sliding_window", "sdpa"] * 3
    assert layers[0]["attention"]["window"] == 4
    assert [layer["ffn"]["name"] for layer in layers] == ["mlp"] * 2 + ["swiglu"] * 4
    assert [layer["norm"]["name"] for layer in layers] == ["layernorm"] * 5 + ["rmsnorm"]


def test_bad_layer_selectors_are_reported():
    spec = tiny_spec(n_layers=2)
    spec["model"]["overrides"] = [
        {"layers": [5], "ffn": {"name": "swiglu"}},
        {"layers": "4:", "ffn": {"name": "swiglu"}},
        {"layers": "a:b", "ffn": {"name": "swiglu"}},
        {"layers": [0], "ffn": {"name": "swiglu", "nope": 1}},
    ]
    with pytest.raises(SpecError) as err:
        load_spec_dict(spec)
    text = str(err.value)
    assert "model.overrides[0].layers: layer 5 is out of range for 2 layers" in text
    assert "model.overrides[1].layers: '4:' selects no layer of 2" in text
    assert "model.overrides[2].layers: bad layer slice 'a:b'" in text
    assert "model.overrides[3].ffn.nope: unknown option for ffn 'swiglu'" in text


def test_select_layers():
    assert select_layers("1::2", 6) == [1, 3, 5]
    assert select_layers([0, -1], 4) == [0, 3]
    assert select_layers("3", 4) == [3]
    with pytest.raises(ValueError, match="step must not be 0"):
        select_layers("::0", 4)


def test_extends_a_relative_file_and_changing_a_name_drops_old_options(tmp_path):
    write(
        tmp_path,
        "base.toml",
        """
        [model]
        d_model = 32
        n_layers = 2
        n_heads = 4
        attention = { name = "sliding_window", window = 8 }
        ffn = { name = "mlp", activation = "relu" }
    """,
    )
    (tmp_path / "sub").mkdir()
    child = write(
        tmp_path,
        "sub/child.yaml",
        """
        extends: ../base.toml
        model:
          n_layers: 3
          attention: {name: sdpa}
          ffn: {multiplier: 2.0}
    """,
    )
    d = load_spec(child).to_dict()["model"]
    assert d["n_layers"] == 3 and d["d_model"] == 32
    assert d["attention"] == {"name": "sdpa", "dropout": 0.0}
    assert d["ffn"]["activation"] == "relu" and d["ffn"]["multiplier"] == 2.0


def test_extends_a_preset_by_name_and_errors(tmp_path):
    rs = load_spec(SPECS / "gpt2-small.toml")
    assert rs.model.vocab_size == 50257 and rs.position.name == "learned"
    bad = write(tmp_path, "x.toml", 'extends = "gpt3"\n[model]\nd_model = 8\n')
    with pytest.raises(LlmkitError, match="did you mean 'gpt2'"):
        load_spec(bad)
    loop = write(tmp_path, "loop.toml", 'extends = "loop.toml"\n')
    with pytest.raises(LlmkitError, match="circular extends"):
        load_spec(loop)


def test_set_overrides_are_validated_the_same_way():
    spec = tiny_spec()
    rs = load_spec_dict(
        spec,
        [
            "model.attention.name=sliding_window",
            "model.attention.window=3",
            "model.n_layers=3",
            "optimizer.betas=[0.9, 0.95]",
        ],
    )
    assert rs.layers[2].attention.options.window == 3
    assert rs.optimizer.options.betas == (0.9, 0.95)
    with pytest.raises(SpecError, match=r"model\.attention\.window: Input should be greater"):
        load_spec_dict(spec, ["model.attention.name=sliding_window", "model.attention.window=0"])
    with pytest.raises(LlmkitError, match="expected KEY=VALUE"):
        load_spec_dict(spec, ["model.n_layers"])


def test_parse_value():
    assert parse_value("3") == 3 and parse_value("1e-3") == 0.001
    assert parse_value("true") is True and parse_value("sdpa") == "sdpa"
    assert parse_value('{ name = "rope" }') == {"name": "rope"}


def test_merge_replaces_components_with_another_name():
    base = {"a": {"name": "x", "k": 1}, "b": {"c": 1}}
    assert merge(base, {"a": {"name": "y"}, "b": {"d": 2}}) == {
        "a": {"name": "y"},
        "b": {"c": 1, "d": 2},
    }


class NoBiasAttention:
    distribution = "llmkit-nobias"
    name = "nobias"

    @hookimpl
    def register_components(self, register):
        register(
            "attention",
            "plain",
            "llmkit.components.attention.sdpa:SDPAttention",
            summary="test",
            capabilities={"positions": ["embedding", "qk"], "gqa": False},
        )


def test_incompatible_parts_are_refused_naming_both():
    reg = registry_with(NoBiasAttention())
    spec = tiny_spec(attention={"name": "plain"}, position={"name": "alibi"}, n_kv_heads=2)
    with pytest.raises(SpecError) as err:
        load_spec_dict(spec, registry=reg)
    text = str(err.value)
    assert "attention 'plain' does not support position 'alibi'" in text
    assert "does not support n_kv_heads (2) != n_heads (4)" in text


def test_embedding_positions_cannot_be_set_per_layer():
    spec = tiny_spec(position={"name": "rope"})
    spec["model"]["overrides"] = [{"layers": [1], "position": {"name": "learned"}}]
    with pytest.raises(SpecError, match=r"model.layers\[1\].position: 'learned' acts on the"):
        load_spec_dict(spec)
    spec["model"]["overrides"] = [{"layers": [1], "position": {"name": "none"}}]
    rs = load_spec_dict(spec)
    assert [p.position.name for p in rs.layers] == ["rope", "none"]


def test_requires_names_missing_or_old_distributions():
    spec = tiny_spec()
    spec["requires"] = ["llmkit-surely-not-installed>=0.2"]
    with pytest.raises(SpecError, match=r"llmkit-surely-not-installed>=0\.2 is not installed"):
        load_spec_dict(spec)
    spec["requires"] = ["pydantic>=999"]
    with pytest.raises(SpecError, match=r"pydantic>=999 but pydantic 2\."):
        load_spec_dict(spec)
    spec["requires"] = ["pydantic>=2"]
    assert load_spec_dict(spec)


def test_a_component_whose_module_fails_to_import_is_named():
    from tests.testing.fakes import fake_registry

    reg = fake_registry({"kind": "norm", "name": "ghost", "target": "llmkit.no_such_module:G"})
    spec = tiny_spec()
    spec["model"]["norm"] = {"name": "ghost"}
    want = r"model\.norm: norm 'ghost' from llmkit-fake failed to load: ModuleNotFoundError"
    with pytest.raises(SpecError, match=want):
        load_spec_dict(spec, registry=reg)


def test_training_values_checked_before_any_run():
    spec = tiny_spec()
    spec["data"] = {"block_size": spec["model"]["max_seq_len"] + 1}
    with pytest.raises(SpecError, match=r"data\.block_size: 33 exceeds model\.max_seq_len \(32\)"):
        load_spec_dict(spec)
    for seed in (-1, 2**63):
        spec = tiny_spec()
        spec["train"] = {"seed": seed}
        with pytest.raises(SpecError, match=r"train\.seed"):
            load_spec_dict(spec)


@pytest.mark.parametrize("tokens", [[""], ["a", "a"]])
def test_special_tokens_are_non_empty_and_distinct(tokens):
    spec = tiny_spec()
    spec["tokenizer"] = {"special_tokens": tokens}
    with pytest.raises(SpecError, match=r"tokenizer\.special_tokens"):
        load_spec_dict(spec)


def test_spec_text_encoding(tmp_path):
    with pytest.raises(LlmkitError, match="not UTF-8 text"):
        (tmp_path / "x.toml").write_bytes(b"\xff\xfe bad")
        load_spec(tmp_path / "x.toml")
    bom = "\ufeff" + 'name = "bom"\n[model]\nd_model = 8\nn_layers = 1\nn_heads = 2\n'
    assert load_spec(write(tmp_path, "y.toml", bom)).spec.name == "bom"


def test_bad_files(tmp_path):
    with pytest.raises(LlmkitError, match="spec file not found"):
        load_spec(tmp_path / "missing.toml")
    with pytest.raises(LlmkitError, match="invalid TOML"):
        load_spec(write(tmp_path, "x.toml", "[model\n"))
    with pytest.raises(LlmkitError, match="invalid YAML"):
        load_spec(write(tmp_path, "x.yaml", "model: [1,\n"))
    with pytest.raises(LlmkitError, match="unknown spec format"):
        load_spec(write(tmp_path, "x.json", "{}"))


def test_set_name_renames_the_spec_and_keeps_everything_else():
    rs = load_spec(SPECS / "tiny.toml", ["name=my-run"])
    assert (
        rs.spec.name == "my-run"
        and rs.model.n_layers == load_spec(SPECS / "tiny.toml").model.n_layers
    )


def test_a_table_without_name_is_the_default_component_when_another_is_chosen(tmp_path):
    # [optimizer] without a name is AdamW: choosing SGD must not keep AdamW's betas.
    spec = tiny_spec()
    spec["optimizer"] = {"lr": 1e-3, "betas": [0.9, 0.95]}
    assert load_spec_dict(spec, ["optimizer.name=sgd"]).optimizer.name == "sgd"
    kept = load_spec_dict(spec, ["optimizer.name=adamw"])  # the same component: options stay
    assert kept.optimizer.options.betas == (0.9, 0.95)
    write(tmp_path, "base.toml", '[optimizer]\nlr = 1e-3\nbetas = [0.9, 0.95]\n'
                 "[model]\nd_model = 32\nn_layers = 2\nn_heads = 4\n")  # fmt: skip
    child = write(tmp_path, "child.toml", 'extends = "base.toml"\n[optimizer]\nname = "sgd"\n')
    rs = load_spec(child)
    assert rs.optimizer.name == "sgd" and rs.optimizer.options.lr != 1e-3  # SGD's defaults


def test_a_yaml_alias_is_its_own_copy_for_set(tmp_path):
    path = write(tmp_path, "alias.yaml", """
        model:
          d_model: 32
          n_layers: 4
          n_heads: 4
          attention: &attn {name: dense, window: 16}
          overrides:
            - layers: "::2"
              attention: *attn
    """)  # fmt: skip
    rs = load_spec(path, ["model.attention.window=8"])
    assert [plan.attention.options.window for plan in rs.layers] == [16, 8, 16, 8]


def test_a_set_value_nested_too_deeply_is_one_line():
    with pytest.raises(LlmkitError, match="nested too deeply"):
        parse_value("[" * 5000 + "]" * 5000)
