"""Int8 and bf16 weights: what is converted, what is kept, tied heads, sizes, bytes read per
decoding step, the ``auto`` choice and accuracy."""

from __future__ import annotations

import io
import json

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmkit import cli, hardware
from llmkit.data.tokenizer import train_char
from llmkit.inference import Generator, Sampling, generate_batch
from llmkit.inference import quantize as quantize_module
from llmkit.inference.quantize import (
    PACKED_BYTES_PER_CHANNEL,
    BF16Linear,
    DynamicInt8Linear,
    Int8DigitsLinear,
    Int8Embedding,
    Int8Linear,
    LowPrecisionEmbedding,
    bf16_packing_available,
    choose_method,
    decode_read_bytes,
    digits_available,
    int8_mm_available,
    quantize_model,
    weight_bytes,
)
from llmkit.model import build_model
from llmkit.runs import TOKENIZER_FILE, save_spec
from llmkit.runs.checkpoints import WEIGHTS, save_weights
from llmkit.spec import load_spec_dict
from tests.helpers import tiny_spec
from tests.inference.test_int8_linear import needs_digits, needs_fbgemm

#: ``weight_only``: the plain int8 weight-only layer (``Int8Linear``, what a CPU without
#: fbgemm or a GPU gets); ``digits``: the weight_only backend where fbgemm works.
BACKENDS = [
    "weight_only",
    pytest.param("digits", marks=needs_digits),
    pytest.param("dynamic", marks=needs_fbgemm),
]
HEAD_TYPES = {
    "weight_only": Int8Linear,
    "digits": Int8DigitsLinear,
    "dynamic": DynamicInt8Linear,
    "bf16": BF16Linear,
}


@pytest.fixture(autouse=True)
def _weight_only_layer(request, monkeypatch):
    """Tests parametrized with backend ``weight_only``, and tests that ask for fixture
    ``plain_int8``, get ``Int8Linear`` from ``backend="weight_only"``."""
    callspec = getattr(request.node, "callspec", None)
    plain = callspec is not None and callspec.params.get("backend") == "weight_only"
    if plain or "plain_int8" in request.fixturenames:
        monkeypatch.setattr(quantize_module, "digits_available", lambda: False)
    else:  # the test models are small: every layer takes the digits where fbgemm works
        monkeypatch.setattr(quantize_module, "DIGITS_MIN_WEIGHTS", 0)


def test_only_large_layers_take_the_digits(monkeypatch):
    lin = nn.Linear(64, 32)
    monkeypatch.setattr(quantize_module, "DIGITS_MIN_WEIGHTS", 64 * 32 + 1)
    assert type(quantize_module._convert(lin, "weight_only")) is Int8Linear
    monkeypatch.setattr(quantize_module, "DIGITS_MIN_WEIGHTS", 64 * 32)
    want = Int8DigitsLinear if digits_available() else Int8Linear
    assert type(quantize_module._convert(lin, "weight_only")) is want


@pytest.fixture
def plain_int8():
    """Marks a test whose weight_only layers are ``Int8Linear`` (see the autouse fixture)."""


def _model(**model):
    torch.manual_seed(0)
    spec = tiny_spec(d_model=64, vocab_size=128, **{"position": {"name": "rope"}, **model})
    return build_model(load_spec_dict(spec)).eval()


def _convert(model, backend, **kw):
    if backend == "bf16":
        return quantize_model(model, "bf16", **kw)
    return quantize_model(model, backend="weight_only" if backend == "digits" else backend, **kw)


@pytest.mark.skipif(not int8_mm_available(), reason="no aten._weight_int8pack_mm")
def test_int8_weight_only_multiplies_in_bf16_where_asked_and_aligned(monkeypatch, plain_int8):
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    q = Int8Linear.from_float(lin)
    assert not q.bf16_products  # off until quantize_model finds native bf16
    x = torch.randn(2, 3, 64)
    exact = F.linear(x, q.dequantized(), lin.bias).detach()
    plain = q(x)
    assert q.use_bf16_products()
    got = q(x)
    assert got.shape == exact.shape and got.dtype == torch.float32
    assert not torch.equal(got, plain)  # a different product ran
    torch.testing.assert_close(got, exact, rtol=2e-2, atol=2e-2 * float(exact.abs().max()))
    assert not Int8Linear.from_float(nn.Linear(40, 8)).use_bf16_products()  # 40 % 32 != 0
    for fast in (False, True):
        monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda fast=fast: fast)
        model = quantize_model(_model(), backend="weight_only")
        flags = {m.bf16_products for m in model.modules() if isinstance(m, Int8Linear)}
        assert flags == {fast}


def test_bf16_linear_multiplies_in_bf16_and_returns_the_input_dtype():
    torch.manual_seed(0)
    lin = nn.Linear(32, 16)
    b = BF16Linear.from_float(lin)
    assert b.weight.dtype == torch.bfloat16 and b.bias is not None
    x = torch.randn(4, 32)
    want = F.linear(x.bfloat16(), lin.weight.bfloat16()).float() + lin.bias
    torch.testing.assert_close(b(x), want)
    assert b(x).dtype == torch.float32


needs_packing = pytest.mark.skipif(not bf16_packing_available(), reason="no oneDNN bf16 packing")


def test_one_row_bf16_product_is_linear_with_onednn_switched_back_on(monkeypatch):
    torch.manual_seed(0)
    w, x = torch.randn(300, 96).bfloat16(), torch.randn(1, 96).bfloat16()
    want = F.linear(x.double(), w.double())  # exact products of the bf16 values
    got = quantize_module.one_row_bf16_product(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == (1, 300)
    torch.testing.assert_close(got.double(), want, rtol=8e-3, atol=1e-2)  # bf16 result
    seen = []

    class Stub:  # records the switch during the product
        @staticmethod
        def linear(*args):
            seen.append(torch.backends.mkldnn.enabled)
            return F.linear(*args)

    monkeypatch.setattr(quantize_module, "F", Stub)
    quantize_module.one_row_bf16_product(x, w)
    assert seen == [False]
    monkeypatch.undo()
    assert torch.backends.mkldnn.enabled
    with pytest.raises(RuntimeError):
        quantize_module.one_row_bf16_product(x, w.t())  # mismatched shapes
    assert torch.backends.mkldnn.enabled  # restored after an error too


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=needs_packing)])
def test_bf16_linear_takes_the_one_row_product_for_one_row_only(packed, monkeypatch):
    torch.manual_seed(0)
    b = BF16Linear.from_float(nn.Linear(40, 24))
    if packed:
        assert b.pack()
    rows: list[int] = []
    real = quantize_module.one_row_bf16_product

    def spy(x, w):
        rows.append(x.numel() // x.shape[-1])
        return real(x, w)

    monkeypatch.setattr(quantize_module, "one_row_bf16_product", spy)
    with torch.no_grad():
        for shape in [(1, 40), (1, 1, 40), (40,), (3, 40), (1, 3, 40)]:
            x = torch.randn(shape)
            want = F.linear(x.bfloat16(), b.weight).float() + b.bias
            torch.testing.assert_close(b(x), want, rtol=1e-2, atol=1e-2)
    assert rows == [1, 1, 1]  # not the three-row calls (a batch-1 prefill among them)
    x = torch.randn(1, 40, requires_grad=True)
    b(x).sum().backward()  # a gradient takes the plain product
    assert rows == [1, 1, 1] and x.grad is not None


def test_one_row_products_on_threads_leave_onednn_switched_on():
    from concurrent.futures import ThreadPoolExecutor

    torch.manual_seed(0)
    w, x = torch.randn(64, 32).bfloat16(), torch.randn(1, 32).bfloat16()
    want = quantize_module.one_row_bf16_product(x, w)
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda _: quantize_module.one_row_bf16_product(x, w), range(400)))
    assert all(torch.equal(o, want) for o in outs)
    assert torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False  # a user's own "off" is kept
    try:
        quantize_module.one_row_bf16_product(x, w)
        assert not torch.backends.mkldnn.enabled
    finally:
        torch.backends.mkldnn.enabled = True


def _several_rows_match(layer: BF16Linear, weight: Tensor, bias: Tensor) -> None:
    """Three rows (the packed product where there is one) give F.linear of these weights."""
    x = torch.randn(3, layer.in_features)
    with torch.no_grad():
        want = F.linear(x.bfloat16(), weight.bfloat16()).float() + bias
        torch.testing.assert_close(layer(x), want, rtol=1e-2, atol=1e-2)


@needs_packing
def test_packed_bf16_linear_gives_the_same_products_and_stays_a_plain_module():
    import copy

    torch.manual_seed(0)
    lin = nn.Linear(40, 24)
    plain, b = BF16Linear.from_float(lin), BF16Linear.from_float(lin)
    assert b.pack() and b.packed and b.packed_weight.is_mkldnn and not plain.packed
    assert not b.weight.is_mkldnn and torch.equal(b.weight, plain.weight)  # kept for one row
    assert "packed" in repr(b)
    for shape in [(1, 40), (8, 40), (2, 5, 40)]:
        x = torch.randn(shape)
        with torch.no_grad():
            got, want = b(x), plain(x)
        assert got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)  # bf16 products
    state = b.state_dict()
    assert list(state) == ["bias", "weight"] and not state["weight"].is_mkldnn
    assert torch.equal(state["weight"], plain.weight)
    twin = copy.deepcopy(b)
    assert twin.packed and twin.weight is not b.weight
    assert twin.packed_weight is not None and twin.packed_weight is not b.packed_weight
    _several_rows_match(twin, lin.weight, lin.bias)
    moved = b.to("cpu")
    assert moved.packed
    _several_rows_match(moved, lin.weight, lin.bias)
    other = BF16Linear.from_float(nn.Linear(40, 24))
    other.pack()
    other.load_state_dict(plain.state_dict())  # the packed copy follows the new weights
    assert other.packed
    _several_rows_match(other, lin.weight, lin.bias)
    fp = BF16Linear.from_float(lin)
    fp.weight = fp.weight.float()  # only bf16 weights are packed
    assert not fp.pack() and not fp.packed
    buf = io.BytesIO()
    torch.save(b, buf)  # pickled plain, packed again on load
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.packed
    _several_rows_match(loaded, lin.weight, lin.bias)


@needs_packing
def test_the_packed_copy_follows_writes_to_the_plain_weight():
    torch.manual_seed(0)
    lin, new = nn.Linear(40, 24), torch.randn(24, 40)
    b = BF16Linear.from_float(lin)
    assert b.pack()
    _several_rows_match(b, lin.weight, lin.bias)
    with torch.no_grad():
        b.weight.copy_(new.bfloat16())  # in place, as a tied embedding's owner might
    _several_rows_match(b, new, lin.bias)
    b.weight = (2 * new).bfloat16()  # replaced
    _several_rows_match(b, 2 * new, lin.bias)
    assert b.packed


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=needs_packing)])
def test_a_model_quantized_under_inference_mode_runs(packed, monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: packed)
    model = _model()
    idx = torch.randint(0, 128, (2, 8))
    with torch.inference_mode():  # its weights are inference tensors: no write counter
        q = quantize_model(model, "bf16")
        assert q.lm_head.packed is packed and q.lm_head.weight.is_inference()
        got = q(idx).logits
        one = q(idx[:1, :1]).logits
    with torch.no_grad():
        want = model(idx).logits
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert one.shape == (1, 1, 128)


def test_bf16_linear_returns_each_input_dtype_with_and_without_a_bias():
    torch.manual_seed(0)
    lin = nn.Linear(40, 24)
    for bias in (True, False):
        b = BF16Linear(lin.weight, lin.bias if bias else None)
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            for shape in [(40,), (1, 40), (3, 40), (0, 40)]:
                with torch.no_grad():
                    y = b(torch.randn(shape, dtype=dtype))
                assert y.dtype == dtype and y.shape == (*shape[:-1], 24)


def test_a_layer_pickled_before_the_packed_copy_existed_still_runs():
    b = BF16Linear.from_float(nn.Linear(40, 24))
    state = b.__getstate__()
    for key in ("packed_weight", "_packed_of", "_repack"):
        state.pop(key)  # what an older llmkit pickled
    old = BF16Linear.__new__(BF16Linear)
    old.__setstate__(state)
    with torch.no_grad():
        torch.testing.assert_close(old(torch.ones(2, 40)), b(torch.ones(2, 40)))


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=needs_packing)])
def test_a_deepcopy_keeps_the_tie_hooks_and_attributes(packed, monkeypatch):
    import copy

    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: packed)
    q = quantize_model(_model(), "bf16")
    assert q.lm_head.packed is packed
    q.lm_head.note = "kept"
    calls = []
    q.lm_head.register_forward_hook(lambda *a: calls.append(1))
    twin = copy.deepcopy(q)
    assert twin.lm_head.packed is packed and twin.lm_head.note == "kept"
    if not packed:
        assert twin.tok_emb.weight is twin.lm_head.weight  # still one table
    assert weight_bytes(twin) == weight_bytes(q)
    idx = torch.randint(0, 128, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(twin(idx).logits, q(idx).logits, rtol=0, atol=0)
    assert calls == [1, 1]


@pytest.mark.parametrize(
    "method", ["bf16", "int8-weight-only", pytest.param("digits", marks=needs_digits)]
)
def test_fast_cpu_products_step_aside_for_gradients(method, monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: True)
    if method == "int8-weight-only":  # Int8Linear and its bf16 products
        monkeypatch.setattr(quantize_module, "digits_available", lambda: False)
    q = quantize_model(_model(), "int8-weight-only" if method == "digits" else method)
    lin = q.layers[0].attn.qkv
    assert type(lin) is {"bf16": BF16Linear, "digits": Int8DigitsLinear}.get(method, Int8Linear)
    x = torch.randn(2, 64, requires_grad=True)
    lin(x).sum().backward()  # no fast path has a backward: the plain product runs
    assert x.grad is not None and float(x.grad.abs().sum()) > 0


@pytest.mark.parametrize(
    "backend", [*BACKENDS, "bf16", pytest.param("bf16-packed", marks=needs_packing)]
)
def test_a_tied_head_is_converted_and_the_embedding_looks_up_its_table(backend, monkeypatch):
    model = _model()
    packed = backend == "bf16-packed"
    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: packed)  # packs only there
    backend = "bf16" if packed else backend
    q = _convert(model, backend)
    assert q is not model and type(model.layers[0].attn.qkv) is nn.Linear  # a copy
    assert q.quantization.backend == ("weight_only" if backend == "digits" else backend)
    assert not [m for m in q.modules() if type(m) is nn.Linear]  # the head too
    assert type(q.lm_head) is HEAD_TYPES[backend]
    assert q.quantization.linears == 4 * len(model.layers) + 1
    assert not [p for p in q.parameters() if p.shape == (128, 64)]  # no fp32 table left
    idx = torch.randint(0, 128, (2, 16))
    emb = q.tok_emb(idx)
    assert emb.dtype == torch.float32
    if backend == "bf16":
        assert isinstance(q.tok_emb, LowPrecisionEmbedding)
        assert all(m.packed is packed for m in q.modules() if isinstance(m, BF16Linear))
        assert q.tok_emb.weight is q.lm_head.weight  # one plain table (and a packed copy)
        torch.testing.assert_close(emb, model.tok_emb.weight.bfloat16().float()[idx])
    else:
        assert isinstance(q.tok_emb, Int8Embedding)
        w, scale = q.lm_head.int8_weight()
        torch.testing.assert_close(emb, (w.float() * scale[:, None])[idx])  # the head's table
        if backend == "weight_only":
            assert q.tok_emb.weight is q.lm_head.weight  # shared, not copied
    with torch.no_grad():
        ref, got = model(idx).logits, q(idx).logits
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    fp32, small = weight_bytes(model), weight_bytes(q)
    lins = [m for m in model.modules() if type(m) is nn.Linear]
    table = model.tok_emb.weight.numel()
    weights = sum(m.weight.numel() for m in lins if m is not model.lm_head) + table
    channels = sum(m.out_features for m in lins)
    if backend == "bf16":
        # 4 bytes → 2 per weight; a packed layer holds oneDNN's copy too (2 more), of
        # which a decoding step reads one form
        assert fp32 - small == (0 if packed else 2 * weights)
        assert small - decode_read_bytes(q) == (2 * weights if packed else 0)
    elif backend == "weight_only":  # 4 bytes → 1 per weight, plus one fp32 scale a row
        assert fp32 - small == 3 * weights - 4 * channels
    else:  # fbgemm's per-channel data; the embedding's int8 copy of the table and scales
        extra = PACKED_BYTES_PER_CHANNEL * channels + table + 4 * 128
        assert fp32 - small == 3 * weights - extra


@pytest.mark.parametrize("backend", BACKENDS)
def test_untied_head_is_quantized_and_head_false_keeps_it(backend):
    model = _model(tie_embeddings=False)
    q = _convert(model, backend)
    assert not any(type(m) is nn.Linear for m in q.modules())
    assert type(q.lm_head) is HEAD_TYPES[backend]
    assert type(q.tok_emb) is nn.Embedding and q.tok_emb.weight.dtype == torch.float32
    kept = _convert(model, backend, head=False)
    assert type(kept.lm_head) is nn.Linear
    tied = _convert(_model(), backend, head=False)
    assert type(tied.lm_head) is nn.Linear and tied.lm_head.weight is tied.tok_emb.weight


def test_decode_read_bytes_leaves_out_lookups_only(plain_int8):
    model = _model(position={"name": "learned"})
    params = {id(p): p for p in model.parameters()}
    wpe = model.position.wpe.weight
    # the tied table is read whole by the fp32 head; the position table is looked up
    assert decode_read_bytes(model) == weight_bytes(model) - 4 * wpe.numel()
    q = quantize_model(model, backend="weight_only")
    lins = [m for m in q.modules() if isinstance(m, Int8Linear)]
    int8 = sum(m.weight_nbytes() for m in lins)
    rest = sum(
        4 * p.numel()
        for p in params.values()
        if p.dim() == 1 and p is not wpe  # norms and biases
    )
    assert decode_read_bytes(q) == int8 + rest
    assert weight_bytes(q) == int8 + rest + 4 * wpe.numel()  # the int8 table is shared


def test_auto_picks_the_fastest_decode_on_a_cpu(monkeypatch):
    from llmkit.inference import quantize as quantize_module

    model = _model()
    monkeypatch.setattr(quantize_module, "dynamic_available", lambda: True)
    for fast_bf16 in (False, True):  # fbgemm's int8 decodes faster than bf16 weights
        monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda fast=fast_bf16: fast)
        assert choose_method("cpu") == "int8"
        assert quantize_model(model, "auto").quantization.method == "int8"
    monkeypatch.setattr(quantize_module, "digits_available", lambda: True)
    assert choose_method("cpu", "weight_only") == "int8"  # fbgemm's two-digit product
    monkeypatch.setattr(quantize_module, "digits_available", lambda: False)
    assert choose_method("cpu", "weight_only") == "bf16"  # int8 here would not be fbgemm's
    monkeypatch.setattr(quantize_module, "dynamic_available", lambda: False)
    assert choose_method("cpu") == "bf16"  # without fbgemm, bf16 where it is native
    q = quantize_model(model, "auto")
    assert q.quantization.method == "bf16" and isinstance(q.lm_head, BF16Linear)
    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: False)
    assert choose_method("cpu") == "int8"


@pytest.mark.parametrize("backend", [*BACKENDS, "bf16"])
def test_converted_model_generates_with_the_kv_cache(backend):
    q = _convert(_model(), backend)
    prompts = [[1, 2, 3, 4], [5]]
    cfg = Sampling(max_new_tokens=10, temperature=0)
    got = generate_batch(q, prompts, cfg)
    assert [len(r.ids) for r in got] == [10, 10]
    seq = torch.tensor([prompts[0]])
    with torch.no_grad():
        for _ in range(10):
            seq = torch.cat([seq, q(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert got[0].ids == seq[0, 4:].tolist()


def test_errors():
    model = _model()
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_model(model, "int4")
    with pytest.raises(ValueError, match="unknown backend"):
        quantize_model(model, backend="magic")
    with pytest.raises(ValueError, match="no dynamic backend"):
        quantize_model(model, "int8-weight-only", backend="dynamic")


def test_int8_weight_only_is_one_name_for_the_weight_only_backend():
    from llmkit.cli.common import QUANTIZE
    from llmkit.inference.quantize import METHODS

    assert QUANTIZE == METHODS  # the CLI's choices, kept torch-free
    q = quantize_model(_model(), "int8-weight-only")
    assert q.quantization.backend == "weight_only" and q.quantization.method == "int8"
    assert type(q.lm_head) is (Int8DigitsLinear if digits_available() else Int8Linear)


def test_cli_eval_reports_both_sizes_and_perplexities(tmp_path, capsys):
    tok = train_char(["hello there, general kenobi.\n"])
    spec = tiny_spec(vocab_size=tok.vocab_size, d_model=64, position={"name": "rope"})
    spec["tokenizer"] = {"kind": "char"}
    rs = load_spec_dict(spec)
    torch.manual_seed(0)
    save_spec(rs, tmp_path)
    save_weights(build_model(rs), tmp_path / WEIGHTS)
    tok.save(tmp_path / TOKENIZER_FILE)
    data = tmp_path / "text.txt"
    data.write_text("hello there, general kenobi.\n" * 8)
    argv = ["eval", str(tmp_path), "--data", str(data), "--quantize", "int8", "--device", "cpu"]
    assert cli.main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    err = captured.err  # with --json the human report goes to stderr, the JSON to stdout
    assert "int8" in err and "smaller" in err and "perplexity" in err
    report = json.loads(captured.out)
    assert report["int8"]["weight_bytes"] < report["weight_bytes"]
    assert abs(report["int8"]["loss"] - report["loss"]) < 0.05
    for method in ("bf16", "int8-weight-only"):
        assert cli.main([*argv[:-4], "--quantize", method, "--json", "--no-save"]) == 0
        captured = capsys.readouterr()
        out = json.loads(captured.out)[method]
        assert out["backend"] == ("bf16" if method == "bf16" else "weight_only")
        twice = "hold their weights twice" in captured.err
        if method == "bf16" and out["weight_bytes"] == report["weight_bytes"]:
            assert hardware.cpu_has_fast_bf16() and twice  # plain and packed: 2 + 2 bytes
        else:
            assert out["weight_bytes"] < report["weight_bytes"] and not twice
        assert abs(out["loss"] - report["loss"]) < 0.05
    for quantize in ("int8", "int8-weight-only", "bf16", "auto"):
        gen = Generator(str(tmp_path), quantize=quantize)
        assert gen.generate("he", max_new_tokens=3)[0].ids
