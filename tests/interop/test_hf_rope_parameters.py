"""transformers' rope_parameters to llmkit's rope options and back (llmkit.interop.rotary):
the same frequencies and attention factor as transformers' own rope init functions."""

from __future__ import annotations

import math

import pytest

from llmkit.components.position.rope import RotaryOptions
from llmkit.interop.rotary import rope_options_from_hf, rope_parameters_to_hf
from tests.components.test_rope_scaling import (
    CASES,
    HEAD_DIM,
    IDS,
    build,
    hf_config,
    hf_init,
    rel_close,
    without_name,
)


@pytest.mark.parametrize(("case", "hf", "max_pos", "options"), CASES, ids=IDS)
def test_rope_options_from_hf(case, hf, max_pos, options):
    fraction = hf.get("partial_rotary_factor", 1.0)
    got = rope_options_from_hf(hf, HEAD_DIM, 1.0, max_pos)
    assert got["name"] == "rope"
    assert RotaryOptions(**without_name(got)) == RotaryOptions(**options)
    # A config-level partial_rotary_factor counts too (one in rope_parameters wins).
    inner = {k: v for k, v in hf.items() if k != "partial_rotary_factor"}
    again = rope_options_from_hf(inner, HEAD_DIM, fraction, max_pos)
    assert RotaryOptions(**without_name(again)) == RotaryOptions(**options)
    # Back to transformers: the same frequencies and attention factor.
    back = rope_parameters_to_hf(got)
    pos_for_hf = options["original_max_seq_len"] if options["scaling"] == "dynamic" else max_pos
    want, want_attn = hf_init(hf_config(back, pos_for_hf))
    r = build(**options)
    rel_close(r.inv_freq, want)
    assert r.attention_factor == pytest.approx(want_attn, rel=1e-6)
    # Round trip from llmkit options.
    there = rope_options_from_hf(back, HEAD_DIM, 1.0, pos_for_hf)
    assert RotaryOptions(**without_name(there)) == RotaryOptions(**options)


def test_rope_mapping_edge_cases():
    assert rope_options_from_hf({"rope_type": "default", "rope_theta": 5e5}, 64, 1.0, 8192) == {
        "name": "rope",
        "theta": 5e5,
    }
    legacy = rope_options_from_hf({"type": "linear", "factor": 4}, 64, 0.25, 2048)
    assert legacy == {
        "name": "rope",
        "theta": 10000.0,
        "rotary_fraction": 0.25,
        "scaling": "linear",
        "scaling_factor": 4.0,
    }
    inter = rope_options_from_hf({"rope_type": "default"}, 64, 1.0, 128, pairing="interleaved")
    assert inter["pairing"] == "interleaved"
    assert rope_parameters_to_hf(inter) == {"rope_type": "default", "rope_theta": 10000.0}
    # yarn without factor: max_position_embeddings / original; mscale dropped when unused.
    yarn = rope_options_from_hf(
        {
            "rope_type": "yarn",
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 0,
            "beta_fast": None,
        },
        128,
        1.0,
        16384,
    )
    assert RotaryOptions(**without_name(yarn)) == RotaryOptions(
        scaling="yarn", scaling_factor=4.0, original_max_seq_len=4096
    )
    # longrope with factor < 1 has attention factor 1, as with scaling_factor 1.
    lr = rope_options_from_hf(
        {
            "rope_type": "longrope",
            "short_factor": [1.0],
            "long_factor": [2.0],
            "original_max_position_embeddings": 4096,
        },
        2,
        1.0,
        2048,
    )
    assert lr["scaling_factor"] == 1.0
    with pytest.raises(ValueError, match=r"have 1/1 numbers; head_dim 4 × 1\.0 needs 2"):
        rope_options_from_hf(
            {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, 4, 1.0, 8
        )
    with pytest.raises(ValueError, match="'proportional' has no llmkit rope equivalent"):
        rope_options_from_hf({"rope_type": "proportional"}, 64, 1.0, 128)
    with pytest.raises(ValueError, match="scaling='ntk' has no transformers rope_type"):
        rope_parameters_to_hf({"name": "rope", "scaling": "ntk", "scaling_factor": 2.0})
    with pytest.raises(ValueError, match="not rope options"):
        rope_parameters_to_hf({"name": "alibi"})
    assert math.isclose(
        build(**CASES[IDS.index("yarn")][3]).attention_factor, 0.1 * math.log(4) + 1
    )
