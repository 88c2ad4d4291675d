"""Hugging Face checkpoints in and out: in memory (:func:`hf_to_llmkit`, :func:`llmkit_to_hf`)
and between directories (:func:`import_hf`, :func:`export_hf`).

Import reads ``config.json``, picks the family by ``model_type``, writes llmkit's spec for it,
builds the model and fills it through the family's tensor rules; every checkpoint tensor
must be used and every model tensor filled. Export asks each family for a config in turn;
the first that can hold the spec wins, and the config it wrote must import back to the same
model (so a setting the family would drop is refused, by name, instead of lost). What no
family holds can go out as remote code (:mod:`llmkit.interop.remote`), which import reads
back too.
"""

from __future__ import annotations

import copy
import fnmatch
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from llmkit.errors import LlmkitError, first_line
from llmkit.interop import hf_files, remote
from llmkit.interop.family import Family, Refused
from llmkit.interop.mapping import Rule, to_hf, to_llmkit
from llmkit.spec import Resolved, ResolvedSpec, resolve

T = TypeVar("T")


def _families() -> tuple[Family, ...]:
    """Every module of :mod:`llmkit.interop.families` defines ``FAMILY``; export tries them
    by ascending ``Family.priority``."""
    import importlib
    import pkgutil

    from llmkit.interop import families

    found = []
    for info in pkgutil.iter_modules(families.__path__):
        module = importlib.import_module(f"{families.__name__}.{info.name}")
        found.append(module.FAMILY)
    return tuple(sorted(found, key=lambda f: (f.priority, type(f).__name__)))


#: Every family, in the order export tries them.
FAMILIES: tuple[Family, ...] = _families()
#: The model table's own settings that matter only in training: export does not compare
#: them (a component's options name theirs: ``ComponentOptions.training_only``).
TRAINING_ONLY = {"dropout", "init_std", "scaled_residual_init"}


def supported_model_types() -> dict[str, str]:
    """Every ``model_type`` import reads, with its transformers class name (``llmkit``: a
    remote-code export of llmkit's own)."""
    native = {t: a for f in FAMILIES for t, a in f.architectures.items()}
    return native | {remote.MODEL_TYPE: remote.ARCHITECTURE}


#: What a family's arithmetic on a malformed config.json raises (a string for a size, a zero).
MALFORMED = (TypeError, ValueError, KeyError, IndexError, ZeroDivisionError, RuntimeError)


def family_for(model_type: Any) -> Family:
    """The family that reads ``model_type``; a one-line error listing the supported ones."""
    for fam in FAMILIES:
        if isinstance(model_type, str) and model_type in fam.architectures:
            return fam
    known = ", ".join(sorted(supported_model_types()))
    raise LlmkitError(f"model_type {model_type!r} is not supported (supported: {known})")


def model_table(cfg: dict[str, Any], attention: str = "sdpa") -> dict[str, Any]:
    """llmkit's ``model`` table for an HF config; full-attention layers use ``attention``."""
    table = family_for(cfg.get("model_type")).spec(cfg)
    if attention != "sdpa" and table.get("attention", {}).get("name") == "sdpa":
        table["attention"] = {"name": attention}
    position = table.get("position", {})
    if position.get("scaling") == "dynamic":
        # HF's max_position_embeddings is dynamic NTK's original context, which the model is
        # meant to exceed: llmkit's context is the extended one (generation past max_seq_len
        # would otherwise restart its cache from the last half of the tokens)
        table["max_seq_len"] = int(position["original_max_seq_len"] * position["scaling_factor"])
    return table


def _dynamic_context(cfg: dict[str, Any], rs: ResolvedSpec) -> None:
    """HF's max_position_embeddings of a dynamic-NTK model is the original context."""
    opts = rs.layers[0].get("position")
    if opts is not None and getattr(opts.options, "scaling", None) == "dynamic":
        cfg["max_position_embeddings"] = opts.options.original_max_seq_len


@dataclass
class Imported:
    """An HF checkpoint as an llmkit model: the run's spec, the model (eval mode) and notes."""

    raw: dict[str, Any]
    spec: ResolvedSpec
    model: nn.Module
    config: dict[str, Any]
    source_dtype: str
    notes: list[str] = field(default_factory=list)


def _spec_for(cfg: dict[str, Any], name: str, attention: str) -> tuple[dict, ResolvedSpec]:
    raw = {"name": name, "model": model_table(cfg, attention)}
    try:
        return raw, resolve(copy.deepcopy(raw), source=f"{name} (config.json)")
    except LlmkitError as exc:
        raise LlmkitError(f"config.json maps to a spec llmkit refuses: {exc}") from exc


def _fill(model: nn.Module, ours: dict[str, torch.Tensor]) -> None:
    expected = model.state_dict(keep_vars=True)
    for name, t in ours.items():
        if name not in expected:
            raise LlmkitError(f"mapped tensor {name!r} is not in the model")
        if tuple(t.shape) != tuple(expected[name].shape):
            raise LlmkitError(
                f"{name}: the checkpoint gives shape {tuple(t.shape)}, the model has "
                f"{tuple(expected[name].shape)}"
            )
    missing = sorted(set(expected) - set(ours))
    if missing:
        raise LlmkitError(f"the checkpoint fills no {missing[0]!r}")
    with torch.no_grad():
        for name, p in expected.items():
            p.copy_(ours[name])


# -- checks on the headers, before any real allocation ---------------------------------------

#: config.json keys that count layers and experts: each must be at most the number of
#: tensors in the checkpoint (every layer, every expert has its own), checked before the
#: family reads the config (whose loops run over them).
LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
#: Elements the model may hold beyond the checkpoint's (a tied head, RoPE tables): at least
#: this many (1 GiB in fp32), else as many as the checkpoint has.
EXTRA_ELEMENTS = 1 << 28


def _counts(cfg: dict[str, Any], keys: tuple[str, ...]) -> list[tuple[str, int]]:
    """The integer values of ``keys`` in a config (booleans are not counts)."""
    found = [(k, cfg.get(k)) for k in keys]
    return [(k, v) for k, v in found if isinstance(v, int) and not isinstance(v, bool)]


def _check_counts(where: Path, cfg: dict[str, Any], n_tensors: int) -> None:
    """Layer and expert counts the checkpoint's tensors can hold (a config claiming a
    billion layers is refused before anything loops over them): each at most the number of
    tensors, and layers × experts at most four times it (a routed layer has ≥ 3 tensors per
    expert)."""
    layers, experts = _counts(cfg, LAYER_KEYS), _counts(cfg, EXPERT_KEYS)
    for key, n in layers + experts:
        if n > n_tensors:
            raise LlmkitError(
                f"{where}: {key} = {n}, but the checkpoint holds only {n_tensors} tensors"
            )
    most_layers = max((n for _, n in layers), default=1)
    most_experts = max((n for _, n in experts), default=1)
    if most_layers * max(most_experts, 1) > 4 * n_tensors:
        raise LlmkitError(
            f"{where}: {most_layers} layers of {most_experts} experts, but the checkpoint "
            f"holds only {n_tensors} tensors"
        )


def _check_dtypes(infos: dict[str, hf_files.TensorInfo], ignore: tuple[str, ...]) -> None:
    for name, info in infos.items():
        if not info.floating and not _ignored(name, ignore):
            raise LlmkitError(
                f"{info.file}: tensor {name!r} is {info.dtype}, not a floating-point type "
                "(a quantized checkpoint? llmkit imports float weights)"
            )


def _check_shapes(
    rules: list[Rule],
    infos: dict[str, hf_files.TensorInfo],
    expected: dict[str, tuple[int, ...]],
    ignore: tuple[str, ...],
    tied: bool,
) -> None:
    """Every checkpoint tensor's shape against what the model (built on the meta device)
    expects of it, through the family's rules run on meta tensors: no data, no memory. A
    mismatch names the checkpoint tensor, the expected and the found shape."""
    with torch.device("meta"):
        for rule in rules:
            want = expected.get(rule.ours)
            if want is None:
                raise LlmkitError(f"mapped tensor {rule.ours!r} is not in the model")
            if not rule.theirs:
                continue
            try:  # the checkpoint shapes the model's would be stored as
                parts = rule.split(torch.empty(want))
            except (LlmkitError, *MALFORMED):
                continue  # the joined shape is compared below
            if len(parts) != len(rule.theirs):
                continue
            for name, part in zip(rule.theirs, parts, strict=True):
                info = infos.get(name)
                if info is not None and info.shape != tuple(part.shape):
                    raise LlmkitError(
                        f"{info.file}: tensor {name!r} has shape {info.shape}, the model "
                        f"expects {tuple(part.shape)} (config.json does not fit the weights)"
                    )
        metas = {n: torch.empty(i.shape, dtype=torch.float32) for n, i in infos.items()}
        try:
            ours = to_llmkit(rules, metas, ignore=ignore)
        except MALFORMED as exc:
            raise LlmkitError(f"the weights do not fit config.json ({first_line(exc)})") from exc
    for rule in rules:
        got, want = tuple(ours[rule.ours].shape), expected[rule.ours]
        if got != want:
            names = ", ".join(repr(n) for n in rule.theirs)
            raise LlmkitError(
                f"{rule.ours} (from {names}): the checkpoint gives shape {got}, the model "
                f"expects {want}"
            )
    filled = set(ours) | ({"lm_head.weight"} if tied else set())
    missing = sorted(set(expected) - filled)
    if missing:
        raise LlmkitError(f"the checkpoint fills no {missing[0]!r}")


def _check_size(where: Path, meta: nn.Module, checkpoint_elements: int) -> None:
    """Refuse a model (built on the meta device) that would hold far more than the
    checkpoint's tensors imply: buffers such as RoPE tables sized by an absurd context."""
    params = {id(p): p.numel() for p in meta.parameters()}
    buffers = [(n, b) for n, b in meta.named_buffers()]
    total = sum(params.values()) + sum(b.numel() for _, b in buffers)
    if total <= 2 * checkpoint_elements + EXTRA_ELEMENTS:
        return
    what = ""
    if buffers:
        name, largest = max(buffers, key=lambda nb: nb[1].numel())
        what = f" (largest buffer {name} {tuple(largest.shape)})"
    raise LlmkitError(
        f"{where}: the model would hold {total:,} values{what} for {checkpoint_elements:,} in "
        "the checkpoint; refusing a config that claims far more than its weights"
    )


def _ignored(name: str, ignore: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in ignore)


def hf_to_llmkit(hf_dir: str | Path, *, attention: str = "sdpa") -> Imported:
    """Read a local HF checkpoint into an llmkit model (fp32, eval mode).

    Everything is checked before any real allocation: the weight files' headers (names,
    shapes, dtypes) against the model built on the meta device; then the tensors are read
    (NaN/Inf refused), mapped, and copied into the model."""
    from llmkit.model.transformer import build_on_meta

    d = Path(hf_dir).expanduser()
    cfg = hf_files.read_config(d)
    if remote.is_remote(cfg):
        return _remote_to_llmkit(d, cfg, attention)
    fam = family_for(cfg.get("model_type"))
    cfg = fam.defaults.get(cfg["model_type"], {}) | cfg
    weights = hf_files.open_weights(d)
    _check_counts(d / hf_files.CONFIG, cfg, len(weights.infos))
    try:
        raw, rs = _spec_for(cfg, d.name or "imported", attention)
    except MALFORMED as exc:
        what = f"{d / hf_files.CONFIG}: cannot be read as {cfg['model_type']}"
        raise LlmkitError(f"{what} ({type(exc).__name__}: {exc})") from exc
    named = _with_prefix({n: n for n in weights.infos}, fam)  # the model's name → the file's
    infos = {k: weights.infos[v] for k, v in named.items()}
    tied = rs.model.tie_embeddings
    ignore = tuple(fam.ignore) + (("lm_head.weight",) if tied else ())
    try:
        rules = fam.rules(cfg)
        meta = build_on_meta(rs)
    except MALFORMED as exc:
        raise LlmkitError(f"{d}: the weights do not fit config.json ({first_line(exc)})") from exc
    expected = {k: tuple(v.shape) for k, v in meta.state_dict(keep_vars=True).items()}
    _check_dtypes(infos, ignore)
    _check_shapes(rules, infos, expected, ignore, tied)
    used = [n for n in infos if not _ignored(n, ignore) or (tied and n == "lm_head.weight")]
    _check_size(d / hf_files.CONFIG, meta, sum(infos[n].numel for n in used))
    del meta
    sizes: Counter[str] = Counter()  # elements by dtype: the checkpoint's is the one most hold
    for n in used:
        sizes[infos[n].dtype] += infos[n].numel
    dtypes = [name for name, _ in sizes.most_common()]
    loaded = weights.load(named[n] for n in used)
    tensors = {n: loaded[named[n]] for n in used}
    del loaded
    try:
        ours = to_llmkit(rules, tensors, ignore=ignore)
    except MALFORMED as exc:  # tensors of other shapes than config.json says
        raise LlmkitError(f"{d}: the weights do not fit config.json ({first_line(exc)})") from exc
    if tied:
        head = tensors.get("lm_head.weight")
        if head is not None and not torch.equal(head, ours["tok_emb.weight"]):
            raise LlmkitError("tie_word_embeddings is set but lm_head differs from the embedding")
        ours["lm_head.weight"] = ours["tok_emb.weight"]
    model = _build(rs)
    _fill(model, ours)  # copy_ casts into the fp32 parameters: no fp32 copy of the checkpoint
    del tensors, ours
    model.eval()
    source_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or (dtypes[0] if dtypes else "")
    notes = fam.notes(cfg)
    kernels = {plan.attention.name for plan in rs.layers}
    if attention != "sdpa" and attention not in kernels:  # asked for, and nowhere used
        notes.append(f"--attention {attention} has no effect: the layers use {sorted(kernels)}")
    return Imported(raw, rs, model, cfg, str(source_dtype), notes)


def _build(rs: ResolvedSpec) -> nn.Module:
    """The model for real (its values are overwritten), once the checks have passed."""
    from llmkit import model as model_module

    return model_module.build_model(rs)


def _remote_to_llmkit(d: Path, cfg: dict[str, Any], attention: str) -> Imported:
    """A remote-code export of llmkit's: the spec from config.json, llmkit's own tensors."""
    from llmkit.model.transformer import build_on_meta

    raw = remote.spec_of(cfg, d.name or "imported", attention)
    weights = hf_files.open_weights(d)
    _check_counts(d / hf_files.CONFIG, raw["model"], len(weights.infos))
    try:
        rs = resolve(copy.deepcopy(raw), source=f"{d / hf_files.CONFIG} (llmkit_spec)")
    except LlmkitError as exc:
        raise LlmkitError(f"the llmkit spec in config.json does not resolve here: {exc}") from exc
    tied = rs.model.tie_embeddings
    infos = remote.llmkit_infos(weights.infos, tied)
    try:
        meta = build_on_meta(rs)
    except MALFORMED as exc:
        raise LlmkitError(f"{d}: the llmkit spec in config.json builds no model: {exc}") from exc
    expected = {k: tuple(v.shape) for k, v in meta.state_dict(keep_vars=True).items()}
    _check_dtypes(weights.infos, ())
    for name, info in infos.items():
        if name not in expected:
            raise LlmkitError(f"{info.file}: tensor {remote.PREFIX + name!r} is not in the model")
        if info.shape != expected[name]:
            raise LlmkitError(
                f"{info.file}: tensor {remote.PREFIX + name!r} has shape {info.shape}, the "
                f"model expects {expected[name]}"
            )
    missing = sorted(set(expected) - set(infos))
    if missing:
        raise LlmkitError(f"the checkpoint fills no {remote.PREFIX + missing[0]!r}")
    _check_size(d / hf_files.CONFIG, meta, sum(i.numel for i in weights.infos.values()))
    del meta
    tensors = weights.load_all()
    dtypes = Counter(str(t.dtype).removeprefix("torch.") for t in tensors.values())
    ours = remote.llmkit_tensors(tensors, tied)
    model = _build(rs)
    _fill(model, ours)
    del tensors, ours
    model.eval()
    most = dtypes.most_common(1)[0][0] if dtypes else ""
    source_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or most
    notes = ["an llmkit remote-code export: the spec is config.json's llmkit_spec"]
    kernels = {plan.attention.name for plan in rs.layers}
    if attention != "sdpa" and attention not in kernels:
        notes.append(f"--attention {attention} has no effect: the layers use {sorted(kernels)}")
    return Imported(raw, rs, model, cfg, str(source_dtype), notes)


def _computes(res: Resolved, d_model: int, bias: bool) -> dict[str, Any]:
    """What a model component computes, as its contract says: a kernel of the reference
    attention (``AttentionKernel.full_causal``) by its window and softcap alone, whichever
    kernel it is; any other by name and its options as they take effect
    (``ComponentOptions.effective``) without those that matter only in training
    (``ComponentOptions.training_only``)."""
    opts = res.options
    if getattr(res.record.load(), "full_causal", False):
        window, softcap = getattr(opts, "window", None), getattr(opts, "softcap", None)
        out: dict[str, Any] = {"name": "window" if window else "full"}
        return out | {k: v for k, v in (("window", window), ("softcap", softcap)) if v is not None}
    effective = (
        opts.effective(d_model, bias)
        if hasattr(opts, "effective")
        else opts.model_dump(mode="json")
    )
    skip = getattr(opts, "training_only", frozenset())
    return {"name": res.name} | {k: v for k, v in effective.items() if k not in skip}


def _with_prefix(tensors: dict[str, T], fam: Family) -> dict[str, T]:
    """Names as the ``*ForCausalLM`` model has them: a base model's checkpoint (``wte.weight``
    for GPT-2's ``transformer.wte.weight``) gets the family's prefix."""
    if any(k.startswith(fam.prefix) for k in tensors):
        return tensors
    return {(k if k.startswith(fam.head_names) else fam.prefix + k): v for k, v in tensors.items()}


def _comparable(rs: ResolvedSpec) -> dict[str, Any]:
    """The resolved model table as it computes: training-only settings dropped, every
    component as it computes (:func:`_computes`)."""
    m = rs.model

    def computes(res: Resolved) -> dict[str, Any]:
        return _computes(res, m.d_model, m.bias)

    model = rs.to_dict()["model"]
    model.pop("norm_placement", None)
    for key in ("qkv_bias", "attn_out_bias"):
        model[key] = m.bias if model.get(key) is None else model[key]
    for slot, res in rs.model_slots.items():
        model[slot] = computes(res)
    for section, res in rs.components.items():
        table, _, slot = section.rpartition(".")
        if table == "model" and res is not None:
            model[slot] = computes(res)
    model["layers"] = [{s: computes(r) for s, r in plan.slots.items()} for plan in rs.layers]
    return {k: v for k, v in model.items() if k not in TRAINING_ONLY}


def _differences(a: Any, b: Any, path: str = "model") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += _differences(a.get(k), b.get(k), f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path} ({a!r} here, {b!r} after export)"]


def hf_config_for(rs: ResolvedSpec, prefer: str | None = None) -> tuple[Family, dict[str, Any]]:
    """The first family that holds the spec exactly, and its HF config; the family of the
    ``model_type`` ``prefer`` (an imported run's) is asked first."""
    reasons = []
    order = sorted(FAMILIES, key=lambda f: prefer not in f.architectures)
    for fam in order:
        try:
            cfg = fam.hf_config(rs)
        except (Refused, *MALFORMED) as exc:
            reasons.append(f"{type(fam).__name__.lower()}: {exc}")
            continue
        _dynamic_context(cfg, rs)
        back = resolve({"model": model_table(copy.deepcopy(cfg))})
        diff = _differences(_comparable(rs), _comparable(back))
        if diff:
            reasons.append(f"{cfg['model_type']}: would change {diff[0]}")
            continue
        return fam, cfg
    raise LlmkitError("no Hugging Face architecture holds this model: " + "; ".join(reasons))


def native_hf(
    model: nn.Module, rs: ResolvedSpec, prefer: str | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(HF config, HF state dict) of the first native family that holds the model, spec and
    weights alike (a bias-free LayerNorm's gain must be 1); a one-line refusal otherwise."""
    fam, cfg = hf_config_for(rs, prefer)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    tensors = to_hf(fam.rules(cfg), state)
    cfg = dict(cfg)
    cfg["architectures"] = [fam.architectures[cfg["model_type"]]]
    return cfg, tensors


def llmkit_to_hf(
    model: nn.Module,
    rs: ResolvedSpec,
    dtype: torch.dtype | None = None,
    prefer: str | None = None,
    *,
    remote_code: bool = False,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(HF config, HF state dict) of an llmkit model (``prefer``: see :func:`hf_config_for`).
    What no native family holds is refused, or with ``remote_code`` written as llmkit's
    remote-code checkpoint (``model_type`` ``llmkit``, :mod:`llmkit.interop.remote`)."""
    try:
        cfg, tensors = native_hf(model, rs, prefer)
    except LlmkitError:
        if not remote_code:
            raise
        cfg, tensors = remote.remote_config(rs), remote.remote_tensors(model, rs)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    cfg["torch_dtype"] = str(dtype or next(iter(tensors.values())).dtype).removeprefix("torch.")
    return cfg, tensors


def to_transformers(
    model: nn.Module, rs: ResolvedSpec | None = None, *, remote_code: bool = False
) -> nn.Module:
    """A ``transformers`` model (eval mode) holding an llmkit model's weights, in memory; what
    no native family holds is refused, or with ``remote_code`` the remote-code wrapper
    (``LlmkitForCausalLM`` around llmkit's model, built here from llmkit's own template)."""
    import transformers

    rs = rs if rs is not None else model.spec
    try:
        cfg, tensors = llmkit_to_hf(model, rs)
    except LlmkitError:
        if not remote_code:
            raise
        return remote.in_memory(model, rs)
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")}
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    left = set(missing) - tied - {n for n, _ in hf.named_buffers()}
    if left or unexpected:
        raise LlmkitError(f"transformers' model does not take {sorted(left or unexpected)[0]!r}")
    hf.tie_weights()
    return hf.eval()
