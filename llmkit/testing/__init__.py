"""Conformance checks for llmkit components, importable by plugin authors for their own CI.

Every check takes a registry :class:`~llmkit.registry.Component` record (and optionally a
dict of options) and raises :class:`AssertionError` with a message naming the component and
the property it broke; it returns ``None`` when the component conforms. A plugin's test suite
needs two lines::

    from llmkit.testing import check_component, conformance_params

    @pytest.mark.parametrize("record", conformance_params())
    def test_conforms(record):
        check_component(record)

Per kind (see each ``check_*`` function for the details):

- ``attention``: shapes and dtype, agreement with :func:`reference_attention`, causality,
  bottom-right alignment of queries to keys (how a KV cache presents them), sliding-window
  locality for kernels that declare a ``cache_window``, gradients, determinism, GQA/MQA,
  score biases, key padding masks, non-causal calls, bfloat16; for kernels that declare
  ``supports_document_mask``, packed documents (``document_ids``) equal each document run
  alone, outputs and gradients.
- ``ffn`` and ``norm``: shape and dtype, position-wise (no mixing across tokens or batch
  rows), gradients to the input and every parameter, determinism, bfloat16.
- ``position``: ``acts_on`` agrees with the record's capabilities, every site it does not
  declare is left alone, embeddings depend on position, rotary scores depend only on relative
  position, incremental (one token at a time) calls equal full ones, (B, T) positions.
- ``optimizer``: every trainable parameter in exactly one group, ``initial_lr`` on every
  group, a regression loss falls clearly in 50 steps, ``state_dict`` round trips exactly, the
  step follows ``group["lr"]`` (which schedules set).
- ``schedule``: warmup rises to a peak of 1.0, never negative, non-increasing over the last
  20% of steps, a pure function of the step.
- ``block``: keeps its parts, shape and dtype, residual path, gradients, causality, and inside a
  tiny model training and KV-cache decoding (:mod:`llmkit.testing.block`).
- ``qk_transform``: shapes with grouped kv heads, token by token, gradients, and tiny models
  with plain and windowed kernels (:mod:`llmkit.testing.qk_transform`).
- ``dataset``: ``splits(seed)`` gives non-empty ``train`` and ``validation`` with a string
  ``text`` column, the same for the same seed, validation not a copy of train; a one-line
  ``describe()``; a stable ``fingerprint()`` (:mod:`llmkit.testing.dataset`; with required
  options and none given, the generic part only).
- ``adapter``: an ``AdapterOptions`` model, a ``WeightAdapter`` whose adapted weight keeps
  shape and dtype, starts equal to the base weight, is a function of the weight and its own
  trainable parameters alone, and gives the same outputs parametrized on a linear layer and
  merged (:mod:`llmkit.testing.adapter`).
- ``logger``: a ``MetricsLogger`` that takes ordered records (numbers, NaN, strings, slash
  names), a resumed build, one ``close()``, and writes nothing outside its run directory
  (:mod:`llmkit.testing.logger`; skipped when the tracker's package is missing).
- any other kind (plugins may add kinds): the kind's own check, which it names in
  ``register_kinds(..., check="module:attr")``; without one, :func:`check_generic`: the
  options model validates its defaults (unless it has required fields, e.g. a dataset's
  paths) and the target loads as a callable.

Every kind: the options model is pydantic and rejects unknown keys.

:func:`check_model_combination` builds a tiny model from named parts through the spec loader
and checks training and KV-cache decoding end to end.

Capabilities the checks read (all optional): ``requires`` (``"cuda"`` selects the device and
skips the parameter without one), ``gqa`` and ``positions`` and ``causal_only`` and
``kv_cache`` (attention, as in ``registry.toml``), ``approximate`` (attention: True skips the
comparisons with :func:`reference_attention`), ``dtypes`` (model components: the dtypes to
test, default ``["float32", "bfloat16"]``), ``position_wise`` (ffn/norm: False skips the
no-mixing check, e.g. capacity-limited MoE routing), ``acts_on`` (position).

One module per kind (``llmkit.testing.attention``, ``.ffn``, ``.norm``, ``.position``,
``.optimizer``, ``.schedule``, ``.block``, ``.qk_transform``, ``.dataset``, ``.adapter``,
``.logger``), ``.generic`` for what every kind is checked for, ``.suite`` for
the dispatch over the registry, ``.combinations`` for whole models and ``.common`` for shared
helpers; this package re-exports the public names. pytest is imported only inside
:func:`conformance_params`.
"""

from llmkit.testing.adapter import check_adapter
from llmkit.testing.attention import check_attention, reference_attention
from llmkit.testing.block import check_block
from llmkit.testing.combinations import check_model_combination, tiny_model_spec
from llmkit.testing.common import build_options, init_like_model, small_context
from llmkit.testing.dataset import check_dataset
from llmkit.testing.ffn import check_ffn
from llmkit.testing.generic import check_generic, check_options_model
from llmkit.testing.logger import check_logger
from llmkit.testing.norm import check_norm
from llmkit.testing.optimizer import check_optimizer
from llmkit.testing.position import check_position
from llmkit.testing.qk_transform import check_qk_transform
from llmkit.testing.schedule import check_schedule
from llmkit.testing.suite import check_component, conformance_params

__all__ = [
    "build_options",
    "check_adapter",
    "check_attention",
    "check_block",
    "check_component",
    "check_dataset",
    "check_ffn",
    "check_generic",
    "check_logger",
    "check_model_combination",
    "check_norm",
    "check_optimizer",
    "check_options_model",
    "check_position",
    "check_qk_transform",
    "check_schedule",
    "conformance_params",
    "init_like_model",
    "reference_attention",
    "small_context",
    "tiny_model_spec",
]
