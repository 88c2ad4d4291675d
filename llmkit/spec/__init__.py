"""Spec files: pydantic models, loading (TOML/YAML, ``extends``, presets, ``--set``), and
two-pass resolution against the registry.

Pass one validates the outer structure (:class:`Spec`); pass two validates each component
reference ``{ name = "...", <options> }`` against that component's own options model.
Every problem is reported at once, each with its full path (``model.attention.window``).
"""

from __future__ import annotations

import copy
import difflib
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from llmkit.errors import LlmkitError, RegistryError, SpecError

PRESETS_DIR = Path(__file__).with_name("presets")
MODEL_SLOTS = ("attention", "ffn", "norm", "position")
LAYER_SLOTS = ("attention", "ffn", "norm", "position")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ComponentRef(BaseModel):
    """``{ name = "...", <options> }``: options are checked in pass two."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(description="Registered component name (see `llmkit list KIND`).")

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


LayerSelector = list[int] | str


class LayerOverride(Strict):
    """Replace components on selected layers.

    ``layers``: a list of indices (negative counts from the end), or a slice string
    ``"start:stop:step"`` such as ``"2:"`` (layer 2 on) or ``"::2"`` (every other layer).
    """

    layers: LayerSelector = Field(description="Indices [0, 3] or a slice 'start:stop:step'.")
    attention: ComponentRef | None = None
    ffn: ComponentRef | None = None
    norm: ComponentRef | None = None
    position: ComponentRef | None = None


class ModelSpec(Strict):
    """The architecture."""

    vocab_size: int = Field(50304, gt=0, description="Vocabulary size (embedding rows).")
    d_model: int = Field(gt=0, description="Residual-stream width.")
    n_layers: int = Field(gt=0, description="Number of Transformer blocks.")
    n_heads: int = Field(gt=0, description="Query heads.")
    n_kv_heads: int | None = Field(
        None, gt=0, description="Key/value heads (GQA; 1 = MQA); default n_heads."
    )
    head_dim: int | None = Field(None, gt=0, description="Per-head size; default d_model/n_heads.")
    max_seq_len: int = Field(1024, gt=0, description="Longest context the model is built for.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Embedding and residual dropout.")
    bias: bool = Field(True, description="Biases in linear layers (and norms that take one).")
    tie_embeddings: bool = Field(True, description="Share input embedding and output head.")
    norm_placement: Literal["pre", "post"] = Field("pre", description="Pre-LN or post-LN blocks.")
    final_norm: bool = Field(True, description="A norm before the output head.")
    init_std: float = Field(0.02, gt=0, description="Std of the normal weight init.")
    scaled_residual_init: bool = Field(
        True, description="Scale residual output projections by 1/sqrt(2·n_layers) (GPT-2)."
    )
    attention: ComponentRef = Field(default_factory=lambda: ComponentRef(name="sdpa"))
    ffn: ComponentRef = Field(default_factory=lambda: ComponentRef(name="mlp"))
    norm: ComponentRef = Field(default_factory=lambda: ComponentRef(name="layernorm"))
    position: ComponentRef = Field(default_factory=lambda: ComponentRef(name="learned"))
    overrides: list[LayerOverride] = Field(
        default_factory=list, description="Per-layer component replacements."
    )

    @model_validator(mode="after")
    def _heads(self) -> ModelSpec:
        kv = self.n_kv_heads or self.n_heads
        if self.n_heads % kv:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({kv})")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}) "
                "unless head_dim is given"
            )
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.d_model // self.n_heads


class TokenizerSpec(Strict):
    """How text becomes token ids."""

    kind: Literal["bpe", "char"] = Field(
        "bpe", description="Byte-level BPE trained on the corpus, or one token per character."
    )
    path: str | None = Field(
        None, description="A pre-trained tokenizer.json to use instead of training one."
    )
    vocab_size: int | None = Field(
        None, gt=0, description="BPE vocabulary size; default model.vocab_size."
    )
    special_tokens: list[str] = Field(
        default_factory=lambda: ["<|endoftext|>"],
        description="Special tokens; the first one separates documents.",
    )
    min_frequency: int = Field(2, ge=1, description="BPE: minimum pair frequency to merge.")
    train_bytes: int | None = Field(
        20_000_000, gt=0, description="Train the tokenizer on at most this much text."
    )

    @field_validator("special_tokens")
    @classmethod
    def _distinct_tokens(cls, tokens: list[str]) -> list[str]:
        if any(not t for t in tokens):
            raise ValueError("a special token cannot be empty")
        if len(set(tokens)) != len(tokens):
            raise ValueError(f"special tokens must be distinct, got {tokens}")
        return tokens


class DataSpec(Strict):
    """Where the corpus comes from and how it is cut into blocks."""

    source: ComponentRef = Field(
        default_factory=lambda: ComponentRef(name="python-stdlib"),
        description="A registered dataset source (see `llmkit list dataset`).",
    )
    block_size: int | None = Field(
        None, gt=0, description="Tokens per training sequence; default model.max_seq_len."
    )
    cache_dir: str | None = Field(
        None, description="Where tokenized data is cached; default <run>/data."
    )
    num_proc: int = Field(1, ge=1, description="Processes for tokenization (datasets.map).")
    sampling: Literal["packed", "random"] = Field(
        "packed",
        description="packed: every block once per epoch (grid shifted in later epochs); "
        "random: windows starting anywhere, drawn independently (as nanoGPT).",
    )


class TrainSpec(Strict):
    """The training recipe besides optimizer and schedule."""

    batch_size: int = Field(
        16, gt=0, description="Sequences per micro-batch on each process (rank)."
    )
    grad_accum: int = Field(1, gt=0, description="Micro-batches per optimizer step.")
    max_steps: int = Field(1000, gt=0, description="Optimizer steps (the schedule's length).")
    max_time: float | None = Field(None, gt=0, description="Stop after this many seconds.")
    grad_clip: float | None = Field(1.0, gt=0, description="Clip the global grad norm; none=off.")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="auto = bf16 autocast where the hardware has it, else fp32."
    )
    device: str = Field("auto", description="auto (cuda, mps, cpu) or a torch device string.")
    compile: bool = Field(False, description="Wrap the model in torch.compile.")
    activation_checkpointing: bool = Field(
        False, description="Recompute each block's activations in backward."
    )
    seed: int = Field(1337, ge=0, lt=2**63, description="Seeds init, data order and dropout.")
    eval_interval: int = Field(250, gt=0, description="Evaluate every N steps (and at the end).")
    eval_batches: int = Field(20, gt=0, description="Validation batches per evaluation.")
    log_interval: int = Field(10, gt=0, description="Write a metrics line every N steps.")
    checkpoint_interval: int | None = Field(
        None, gt=0, description="Checkpoint every N steps; default eval_interval."
    )
    early_stopping_patience: int | None = Field(
        None, gt=0, description="Stop after N evaluations without a better val loss."
    )
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="A non-finite loss stops the run, or the step is skipped."
    )
    sample_tokens: int = Field(200, ge=0, description="Tokens of the sample printed at the end.")
    sample_prompt: str = Field("", description="Prompt of the sample printed at the end.")
    parallel: Literal["auto", "none", "ddp", "fsdp"] = Field(
        "auto",
        description="Under torchrun: ddp (replicas) or fsdp (FSDP2 sharding); auto = ddp "
        "when launched on several processes. One process trains plainly.",
    )
    fsdp_cpu_offload: bool = Field(
        False, description="FSDP: keep parameters, gradients and optimizer state on the CPU."
    )
    fsdp_reshard_after_forward: bool = Field(
        True, description="FSDP: free gathered parameters after forward (less memory)."
    )
    dist_timeout: float = Field(
        600.0, gt=0, description="Seconds a collective may wait before the job fails."
    )


class Spec(Strict):
    """A whole spec file: architecture plus training recipe."""

    name: str | None = Field(None, description="A name for this spec.")
    description: str | None = None
    extends: str | None = Field(None, description="A spec file (relative path) or preset name.")
    requires: list[str] = Field(
        default_factory=list, description="Distributions needed, e.g. 'llmkit-foo>=0.2'."
    )
    model: ModelSpec
    optimizer: ComponentRef = Field(default_factory=lambda: ComponentRef(name="adamw"))
    schedule: ComponentRef = Field(default_factory=lambda: ComponentRef(name="cosine"))
    tokenizer: TokenizerSpec = Field(default_factory=TokenizerSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)


# -- resolved form ----------------------------------------------------------------------------


@dataclass
class Resolved:
    """A component reference resolved to its registry record and validated options."""

    kind: str
    record: Any  # llmkit.registry.Component
    options: Any  # the component's Options instance

    @property
    def name(self) -> str:
        return self.record.name

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **self.options.model_dump(mode="json")}

    def build(self, *args: Any, **kwargs: Any) -> Any:
        return self.record.load()(*args, **kwargs)


@dataclass
class LayerPlan:
    attention: Resolved
    ffn: Resolved
    norm: Resolved
    position: Resolved


@dataclass
class ResolvedSpec:
    """The spec with every component resolved, and the component of every layer."""

    spec: Spec
    position: Resolved  # model-level scheme (embedding site)
    norm: Resolved  # final norm
    layers: list[LayerPlan]
    optimizer: Resolved
    schedule: Resolved
    dataset: Resolved | None = None
    source: str | None = None
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def model(self) -> ModelSpec:
        return self.spec.model

    def to_dict(self) -> dict[str, Any]:
        """The fully resolved spec: defaults filled, one entry per layer."""
        out = self.spec.model_dump(mode="json", exclude={"extends"}, exclude_none=True)
        m = out["model"]
        m["attention"] = self.layers[0].attention.to_dict() if self.layers else None
        m["ffn"] = self.layers[0].ffn.to_dict() if self.layers else None
        m["norm"] = self.norm.to_dict()
        m["position"] = self.position.to_dict()
        m["n_kv_heads"] = self.model.kv_heads
        m["head_dim"] = self.model.dim_head
        m["layers"] = [
            {slot: getattr(plan, slot).to_dict() for slot in LAYER_SLOTS} for plan in self.layers
        ]
        m.pop("overrides", None)
        out["optimizer"] = self.optimizer.to_dict()
        out["schedule"] = self.schedule.to_dict()
        if self.dataset is not None:
            out["data"]["source"] = self.dataset.to_dict()
        return out


# -- loading ----------------------------------------------------------------------------------


def read_spec_file(path: str | Path) -> dict[str, Any]:
    """Parse a TOML or YAML file into a dict."""
    p = Path(path)
    if not p.is_file():
        raise LlmkitError(f"spec file not found: {p}")
    try:
        text = p.read_text(encoding="utf-8-sig")  # a byte-order mark is allowed
    except UnicodeDecodeError as exc:
        raise LlmkitError(f"{p}: not UTF-8 text (byte {exc.start}: {exc.reason})") from exc
    suffix = p.suffix.lower()
    try:
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            raise LlmkitError(f"{p}: unknown spec format {suffix!r} (use .toml, .yaml or .yml)")
    except tomllib.TOMLDecodeError as exc:
        raise LlmkitError(f"{p}: invalid TOML: {exc}") from exc
    except Exception as exc:
        if isinstance(exc, LlmkitError):
            raise
        raise LlmkitError(f"{p}: invalid YAML: {str(exc).splitlines()[0]}") from exc
    if not isinstance(data, dict):
        raise LlmkitError(f"{p}: a spec must be a table/mapping at the top level")
    return data


def presets() -> dict[str, Path]:
    """Preset names and their files."""
    return {p.stem: p for p in sorted(PRESETS_DIR.glob("*.toml"))}


def merge(base: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``child`` over ``base``. A component table whose ``name`` changes is
    replaced, not merged, so one component's options never leak into another's."""
    out = copy.deepcopy(base)
    for key, value in child.items():
        old = out.get(key)
        if (
            isinstance(old, dict)
            and isinstance(value, dict)
            and not ("name" in value and "name" in old and value["name"] != old["name"])
        ):
            out[key] = merge(old, value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_raw(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a spec file and apply its ``extends`` chain."""
    p = Path(path).resolve()
    if p in _seen:
        chain = " -> ".join(str(s) for s in (*_seen, p))
        raise LlmkitError(f"circular extends: {chain}")
    data = read_spec_file(p)
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise SpecError(["extends: must be a file path or a preset name"], str(path))
    candidate = p.parent / parent
    if candidate.suffix.lower() in (".toml", ".yaml", ".yml") or candidate.is_file():
        if not candidate.is_file():
            raise LlmkitError(f"{path}: extends: file not found: {candidate}")
        base = load_raw(candidate, (*_seen, p))
    else:
        known = presets()
        if parent not in known:
            close = difflib.get_close_matches(parent, list(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise LlmkitError(
                f"{path}: extends: no file or preset named {parent!r}{hint}; "
                f"presets: {', '.join(known) or 'none'}"
            )
        base = load_raw(known[parent], (*_seen, p))
    return merge(base, data)


def parse_value(text: str) -> Any:
    """A ``--set`` value: TOML syntax (numbers, booleans, arrays, inline tables) or a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one dotted ``key.path=value`` in place."""
    key, sep, raw = assignment.partition("=")
    key = key.strip()
    if not sep or not key:
        raise LlmkitError(f"--set {assignment!r}: expected KEY=VALUE, e.g. model.n_layers=4")
    parts = key.split(".")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            try:
                node = node[int(part)]
            except (ValueError, IndexError) as exc:
                where = ".".join(parts[: i + 1])
                raise LlmkitError(f"--set {key}: no list element {where}") from exc
            continue
        if not isinstance(node, dict):
            raise LlmkitError(f"--set {key}: {'.'.join(parts[:i])} is not a table")
        node = node.setdefault(part, {})
    last = parts[-1]
    value = parse_value(raw.strip())
    if isinstance(node, list):
        try:
            node[int(last)] = value
        except (ValueError, IndexError) as exc:
            raise LlmkitError(f"--set {key}: no list element {key}") from exc
    elif isinstance(node, dict):
        if last == "name" and node.get("name") not in (None, value):
            node.clear()  # a different component: its options start from defaults
        node[last] = value
    else:
        raise LlmkitError(f"--set {key}: {'.'.join(parts[:-1])} is not a table")


def load_spec(
    path: str | Path, overrides: list[str] | None = None, registry: Any = None
) -> ResolvedSpec:
    """Load, merge, override, validate and resolve a spec file."""
    data = load_raw(path)
    for assignment in overrides or []:
        apply_override(data, assignment)
    return resolve(data, source=str(path), registry=registry)


def load_spec_dict(
    data: dict[str, Any], overrides: list[str] | None = None, registry: Any = None
) -> ResolvedSpec:
    """Like :func:`load_spec` for an in-memory dict (no ``extends`` from files)."""
    data = copy.deepcopy(data)
    for assignment in overrides or []:
        apply_override(data, assignment)
    return resolve(data, source=None, registry=registry)


# -- validation -------------------------------------------------------------------------------


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _fields_at(model: Any, loc: tuple[Any, ...]) -> list[str]:
    """Field names of the pydantic model found at ``loc`` below ``model``."""
    import typing

    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        fields = getattr(current, "model_fields", None)
        if not fields or part not in fields:
            return []
        ann = fields[part].annotation
        candidates = [ann, *typing.get_args(ann)]
        nxt = None
        for c in candidates:
            for inner in [c, *typing.get_args(c)]:
                if isinstance(inner, type) and issubclass(inner, BaseModel):
                    nxt = inner
        if nxt is None:
            return []
        current = nxt
    return list(getattr(current, "model_fields", {}))


def _pydantic_problems(
    exc: ValidationError, prefix: tuple[Any, ...], model: Any, what: str = ""
) -> list[str]:
    problems = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        path = _path(prefix + loc)
        if err["type"] == "extra_forbidden":
            allowed = _fields_at(model, loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            opts = f" (allowed: {', '.join(allowed)})" if allowed else " (it takes no options)"
            problems.append(f"{path}: unknown {what or 'key'}{hint}{opts}")
        else:
            msg = err["msg"]
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, ") :]
            problems.append(f"{path}: {msg}")
    return problems


def select_layers(selector: LayerSelector, n_layers: int) -> list[int]:
    """Indices chosen by a list (negatives count from the end) or a slice string."""
    if isinstance(selector, list):
        out = []
        for i in selector:
            j = i + n_layers if i < 0 else i
            if not 0 <= j < n_layers:
                raise ValueError(f"layer {i} is out of range for {n_layers} layers")
            out.append(j)
        return sorted(set(out))
    parts = selector.split(":")
    if len(parts) > 3:
        raise ValueError(f"bad layer slice {selector!r}: use 'start:stop:step'")
    try:
        nums = [int(p) if p.strip() else None for p in parts]
    except ValueError as exc:
        raise ValueError(f"bad layer slice {selector!r}: use 'start:stop:step'") from exc
    if len(nums) == 1:  # a single index given as a string
        return select_layers([nums[0]], n_layers) if nums[0] is not None else []
    if len(nums) == 3 and nums[2] == 0:
        raise ValueError(f"bad layer slice {selector!r}: step must not be 0")
    return list(range(n_layers))[slice(*nums)]


class _Resolver:
    def __init__(self, registry: Any) -> None:
        self.registry = registry
        self.problems: list[str] = []

    def ref(self, kind: str, raw: Any, path: str) -> Resolved | None:
        if isinstance(raw, ComponentRef):
            raw = {"name": raw.name, **raw.options}
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            return None  # pass one reports it
        options = {k: v for k, v in raw.items() if k != "name"}
        try:
            record = self.registry.get(kind, raw["name"])
        except RegistryError as exc:
            self.problems.append(f"{path}.name: {exc}")
            return None
        try:
            model = record.options_model()
            opts = model.model_validate(options)
        except ValidationError as exc:
            what = f"option for {kind} {record.name!r}"
            self.problems += _pydantic_problems(exc, tuple(path.split(".")), model, what)
            return None
        except RegistryError as exc:  # the component failed to import
            self.problems.append(f"{path}: {exc}")
            return None
        return Resolved(kind, record, opts)


def _plugins_switched_off(distribution: str, registry: Any) -> list[str]:
    """The llmkit plugins ``distribution`` provides when none of them is in ``registry``
    (switched off by ``LLMKIT_PLUGINS``); empty when one is there or it provides none."""
    import importlib.metadata as md

    loaded = getattr(registry, "plugins", None)
    if loaded is None:
        return []
    from llmkit.hookspecs import PROJECT

    names = sorted(
        ep.name for ep in md.distribution(distribution).entry_points if ep.group == PROJECT
    )
    return [] if any(n in loaded for n in names) else names


def _check_requires(requires: Any, source: str | None, registry: Any = None) -> None:
    if not isinstance(requires, list):
        return
    import importlib.metadata as md

    from packaging.requirements import InvalidRequirement, Requirement

    problems = []
    for item in requires:
        try:
            req = Requirement(str(item))
        except InvalidRequirement as exc:
            problems.append(f"requires: {item!r} is not a valid requirement ({exc})")
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            problems.append(f"requires: {req} is not installed (pip install '{req}')")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            problems.append(f"requires: {req} but {req.name} {have} is installed")
            continue
        off = _plugins_switched_off(req.name, registry)
        if off:
            problems.append(
                f"requires: {req.name} is installed but its plugin {', '.join(off)} is not "
                f"loaded: LLMKIT_PLUGINS={os.environ.get('LLMKIT_PLUGINS', '')!r} leaves it out"
            )
    if problems:
        raise SpecError(problems, source)


def resolve(data: dict[str, Any], source: str | None = None, registry: Any = None) -> ResolvedSpec:
    """Validate a merged spec dict in two passes and resolve every component."""
    if registry is None:
        from llmkit.registry import get_registry

        registry = get_registry()
    data = copy.deepcopy(data)
    data.pop("extends", None)
    _check_requires(data.get("requires", []), source, registry)
    _default_names(data)

    problems: list[str] = []
    spec: Spec | None = None
    try:
        spec = Spec.model_validate(data)
    except ValidationError as exc:
        problems += _pydantic_problems(exc, (), Spec)

    r = _Resolver(registry)
    raw_model = data.get("model") if isinstance(data.get("model"), dict) else {}
    base = {slot: r.ref(slot, raw_model.get(slot), f"model.{slot}") for slot in MODEL_SLOTS}
    optimizer = r.ref("optimizer", data.get("optimizer"), "optimizer")
    schedule = r.ref("schedule", data.get("schedule"), "schedule")
    raw_data = data.get("data") if isinstance(data.get("data"), dict) else {}
    dataset = None
    if "dataset" in getattr(registry, "kinds", {}):
        dataset = r.ref("dataset", raw_data.get("source"), "data.source")

    n_layers = raw_model.get("n_layers") if isinstance(raw_model.get("n_layers"), int) else 0
    per_layer: list[dict[str, Resolved | None]] = [dict(base) for _ in range(max(n_layers, 0))]
    raw_overrides = raw_model.get("overrides", [])
    for i, ov in enumerate(raw_overrides if isinstance(raw_overrides, list) else []):
        if not isinstance(ov, dict) or "layers" not in ov:
            continue
        path = f"model.overrides[{i}]"
        try:
            chosen = select_layers(ov["layers"], n_layers)
        except (ValueError, TypeError) as exc:
            r.problems.append(f"{path}.layers: {exc}")
            continue
        if not chosen:
            r.problems.append(f"{path}.layers: {ov['layers']!r} selects no layer of {n_layers}")
        for slot in LAYER_SLOTS:
            if ov.get(slot) is None:
                continue
            res = r.ref(slot, ov[slot], f"{path}.{slot}")
            for j in chosen:
                per_layer[j][slot] = res
    problems += r.problems

    layers: list[LayerPlan] = []
    if spec is not None and not problems:
        for j, slots in enumerate(per_layer):
            plan = LayerPlan(**slots)  # type: ignore[arg-type]
            problems += _compatibility(plan, base["position"], j)
            layers.append(plan)
        problems += _dimension_checks(spec.model, layers)
        block = spec.data.block_size
        if block is not None and block > spec.model.max_seq_len:
            problems.append(
                f"data.block_size: {block} exceeds model.max_seq_len ({spec.model.max_seq_len})"
            )
    if problems:
        raise SpecError(problems, source)
    assert spec is not None
    return ResolvedSpec(
        spec=spec,
        position=base["position"],  # type: ignore[arg-type]
        norm=base["norm"],  # type: ignore[arg-type]
        layers=layers,
        optimizer=optimizer,  # type: ignore[arg-type]
        schedule=schedule,  # type: ignore[arg-type]
        dataset=dataset,
        source=source,
        raw=data,
    )


DEFAULT_COMPONENTS = {
    "attention": "sdpa",
    "ffn": "mlp",
    "norm": "layernorm",
    "position": "learned",
    "optimizer": "adamw",
    "schedule": "cosine",
    "source": "python-stdlib",
}


def _default_names(data: dict[str, Any]) -> None:
    """Give absent component tables, and tables without ``name``, the default component."""
    model = data.get("model")
    tables = [(data, k) for k in ("optimizer", "schedule")]
    if isinstance(model, dict):
        tables += [(model, k) for k in MODEL_SLOTS]
    section = data.setdefault("data", {})
    if isinstance(section, dict):
        tables.append((section, "source"))
    for parent, key in tables:
        value = parent.setdefault(key, {})
        if isinstance(value, dict):
            value.setdefault("name", DEFAULT_COMPONENTS[key])


def acts_on(position: Resolved) -> set[str]:
    return set(position.record.capabilities.get("acts_on", []))


def _compatibility(plan: LayerPlan, model_position: Resolved, j: int) -> list[str]:
    problems = []
    att, pos = plan.attention, plan.position
    sites = acts_on(pos)
    supported = set(att.record.capabilities.get("positions", ["embedding", "qk", "score_bias"]))
    missing = sites - supported
    if missing:
        problems.append(
            f"model.layers[{j}]: attention {att.name!r} does not support position "
            f"{pos.name!r} (it acts on {', '.join(sorted(missing))}; {att.name!r} supports "
            f"{', '.join(sorted(supported)) or 'none'})"
        )
    if pos is not model_position and "embedding" in sites:
        problems.append(
            f"model.layers[{j}].position: {pos.name!r} acts on the embeddings, so it can only "
            "be set model-wide, not per layer"
        )
    return problems


def _dimension_checks(m: ModelSpec, layers: list[LayerPlan]) -> list[str]:
    problems = []
    caps = [plan.attention.record.capabilities for plan in layers]
    if m.kv_heads != m.n_heads:
        for j, c in enumerate(caps):
            if c.get("gqa") is False:
                problems.append(
                    f"model.layers[{j}].attention: {layers[j].attention.name!r} does not "
                    f"support n_kv_heads ({m.kv_heads}) != n_heads ({m.n_heads})"
                )
    for j, c in enumerate(caps):
        dims = c.get("head_dims")
        if dims and m.dim_head not in dims:
            problems.append(
                f"model.layers[{j}].attention: {layers[j].attention.name!r} supports head "
                f"dims {dims}, not {m.dim_head}"
            )
    return problems
