"""Pipeline parallelism: a :class:`~llmkit.model.transformer.Transformer` cut into stages of
contiguous layers, run by :mod:`torch.distributed.pipelining`'s schedules.

- :func:`split_layers` / :func:`stage_ranges` choose the cut: contiguous layer ranges
  balancing parameter counts (the first stage also carries the embedding, the last the head).
- :class:`PipelineStageModule` is one stage: references to the model's own submodules under
  the model's names (``layers.3.attn.qkv.weight``, ``tok_emb.weight``, ``lm_head.weight``),
  so a stage's ``state_dict`` is a slice of the model's.
- :func:`build_stages` makes this rank's stages (loop-style: rank ``r`` holds stages
  ``r, r + pp, r + 2·pp, …``, what interleaved 1F1B expects) as torch ``PipelineStage`` s.
- :class:`Pipeline` runs a schedule (``gpipe``, ``1f1b``, ``interleaved_1f1b``) over them.

Under pipeline parallelism positions are the defaults (``0..T-1`` for every row, or the
rank's global positions under context parallelism): key padding, KV caches and document
masking are not supported. A model split by tensor or context parallelism before the cut
runs split inside every stage. Auxiliary losses reported through the side channel (an
MoE's load-balancing loss) are dropped: the pipeline trains the ``loss_fn`` of the logits
only (the trainer refuses such a model under ``pp > 1``). Parameters shared by stages
on different ranks (tied embeddings when ``pp > 1``) are refused, since their gradients would
need summing across ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from llmkit.contracts import AttentionInputs, PositionalScheme, SideOutputs
from llmkit.errors import LlmkitError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.pipelining import PipelineStage

__all__ = [
    "SCHEDULES",
    "Pipeline",
    "PipelineStageModule",
    "build_stages",
    "cross_entropy",
    "layer_costs",
    "split_layers",
    "stage_ranges",
]

#: Schedule names and the torch classes they select; the first two run one stage per rank.
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
}
_SINGLE = ("gpipe", "1f1b")


# -- the cut -----------------------------------------------------------------------------------
def split_layers(
    costs: Sequence[float], stages: int, *, first: float = 0.0, last: float = 0.0
) -> list[range]:
    """Cut layers ``0..len(costs)-1`` into ``stages`` contiguous, non-empty ranges.

    A stage's cost is the sum of its layers' ``costs``, plus ``first`` for stage 0 (the
    embedding) and ``last`` for the last stage (the head). The cut minimizes the largest
    stage cost; among the cuts that reach it, the sum of squared stage costs (the most even
    one); among those, the one whose cuts come earliest. Exact (dynamic programming,
    O(stages · layers²)) and deterministic.
    """
    n = len(costs)
    if stages < 1 or stages > n:
        raise LlmkitError(
            f"pipeline: cannot cut {n} layers into {stages} stages (every stage needs at "
            f"least one layer: 1 <= stages <= {n})"
        )
    if any(not c >= 0 for c in costs) or first < 0 or last < 0:
        raise LlmkitError("pipeline: layer costs must be non-negative numbers")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    def cost(s: int, a: int, b: int) -> float:  # stage s holding layers [a, b)
        extra = (first if s == 0 else 0.0) + (last if s == stages - 1 else 0.0)
        return prefix[b] - prefix[a] + extra

    inf = float("inf")
    # phase 1: the smallest largest stage cost, best[s][i] over layers [0, i) in s + 1 stages
    best = [[inf] * (n + 1) for _ in range(stages)]
    for i in range(1, n + 1):
        best[0][i] = cost(0, 0, i)
    for s in range(1, stages):
        for i in range(s + 1, n + 1):
            best[s][i] = min(max(best[s - 1][a], cost(s, a, i)) for a in range(s, i))
    bound = best[stages - 1][n]
    # phase 2: within that bound, the smallest sum of squares (earliest cut on ties)
    sq = [[inf] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    for i in range(1, n + 1):
        c = cost(0, 0, i)
        if c <= bound:
            sq[0][i] = c * c
    for s in range(1, stages):
        for i in range(s + 1, n + 1):
            for a in range(s, i):
                c = cost(s, a, i)
                if c <= bound and sq[s - 1][a] + c * c < sq[s][i]:
                    sq[s][i] = sq[s - 1][a] + c * c
                    cut[s][i] = a
    ranges: list[range] = []
    b = n
    for s in range(stages - 1, -1, -1):
        a = cut[s][b] if s else 0
        ranges.append(range(a, b))
        b = a
    return ranges[::-1]


def _numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def layer_costs(model: nn.Module) -> tuple[list[float], float, float]:
    """``(per-layer costs, embedding cost, head cost)`` of a Transformer, as parameter counts
    (an MoE layer among dense ones counts its experts). The embedding is the token table and
    the positional scheme's parameters; the head the final norm and the output projection
    (counted even when tied: it is the head's compute)."""
    costs = [float(_numel(block)) for block in model.layers]
    first = float(_numel(model.tok_emb) + _numel(model.position))
    last = float(_numel(model.norm_f) + model.lm_head.weight.numel())
    if model.lm_head.bias is not None:
        last += model.lm_head.bias.numel()
    return costs, first, last


def stage_ranges(model: nn.Module, num_stages: int) -> list[range]:
    """The layers of each of ``num_stages`` stages: :func:`split_layers` over
    :func:`layer_costs`."""
    costs, first, last = layer_costs(model)
    return split_layers(costs, num_stages, first=first, last=last)


# -- one stage ---------------------------------------------------------------------------------
class PipelineStageModule(nn.Module):
    """One stage of a Transformer: ``layers`` (contiguous indices) of ``model``, plus the
    embedding when ``is_first`` and the final norm and head when ``is_last``.

    It holds the model's own submodules (no copies) under the model's names: ``tok_emb``,
    ``position``, ``drop``, ``layers.{j}`` (a ``ModuleDict`` keyed by the model's layer
    index), ``layer_positions.{key}`` (per-layer positional schemes its layers use),
    ``norm_f``, ``lm_head``. The model's positional scheme is registered on a later stage only
    when its layers use it (``qk`` / ``score_bias`` sites); an embedding-only scheme is just
    called there (its ``rotate`` is the identity).

    ``forward``: the first stage takes token ids (B, T), the others hidden states (B, T, C);
    the last returns logits (B, T, V), the others hidden states. Positions are ``0..T-1``.
    Blocks are recomputed in backward when ``activation_checkpointing`` (copied from the
    model when the stage is built) is set and the stage is training.
    """

    def __init__(
        self, model: nn.Module, layers: Sequence[int], *, is_first: bool, is_last: bool
    ) -> None:
        super().__init__()
        layers = list(layers)
        if not layers or layers != list(range(layers[0], layers[-1] + 1)):
            raise LlmkitError(f"pipeline stage: layers must be contiguous and non-empty: {layers}")
        #: The model's tensor- and context-parallel state (set before the cut): a stage then
        #: splits its sequence as the model's forward does.
        self.tensor_parallel = getattr(model, "tensor_parallel", None)
        self.context_parallel = getattr(model, "context_parallel", None)
        self.is_first = is_first
        self.is_last = is_last
        self.layer_ids = layers
        self.activation_checkpointing: bool = bool(model.activation_checkpointing)
        if is_first:
            self.tok_emb = model.tok_emb
            self.position = model.position
            self.drop = model.drop
            self.embedding_scale: float = float(model.embedding_scale)
        self.layers = nn.ModuleDict({str(j): model.layers[j] for j in layers})
        # each layer's positional scheme: registered under the model's name where it acts
        self._positions: list[PositionalScheme] = [model.layer_position(j) for j in layers]
        keys = {id(m): k for k, m in model.layer_positions.items()}
        self.layer_positions = nn.ModuleDict()
        for scheme in self._positions:
            if scheme is model.position:
                if not is_first and scheme.acts_on & {"qk", "score_bias"}:
                    self.position = scheme
            elif keys[id(scheme)] not in self.layer_positions:
                self.layer_positions[keys[id(scheme)]] = scheme
        if is_last:
            self.norm_f = model.norm_f
            self.lm_head = model.lm_head
            self.logit_softcap: float | None = model.logit_softcap
        self._reporters = [m for m in self.layers.modules() if isinstance(m, SideOutputs)]

    def forward(self, x: Tensor) -> Tensor:
        """Token ids (first stage) or hidden states in; hidden states or logits (last) out.
        Under tensor parallelism the hidden states between stages are the rank's part of
        the sequence and the logits its part of the vocabulary; under context parallelism
        every tensor holds the rank's chunks of each row, at their global positions."""
        tp, cp = self.tensor_parallel, self.context_parallel
        T = x.shape[1] if self.is_first or tp is None else x.shape[1] * tp.size
        if cp is not None:
            positions = cp.positions(T * cp.cp, x.device)
        else:
            positions = torch.arange(T, device=x.device)
        if self.is_first:
            x = self.tok_emb(x)
            if self.embedding_scale != 1.0:  # as the model: rounded to the activations' dtype
                x = x * torch.tensor(self.embedding_scale, dtype=x.dtype)
            x = self.position.embed(x, positions)
            if self.training and self.drop.p > 0:
                x = self.drop(x)
            if tp is not None:
                x = tp.split_sequence(x)  # sequence parallelism between layers
        recompute = self.activation_checkpointing and self.training
        for scheme, block in zip(self._positions, self.layers.values(), strict=True):
            inputs = AttentionInputs(scheme, positions, None, None, None, cp)
            x = checkpoint(block, x, inputs, use_reentrant=False) if recompute else block(x, inputs)
        for reporter in self._reporters:  # auxiliary losses are not trained under pp
            reporter.pop_side_outputs()
        if self.is_last:
            x = self.lm_head(self.norm_f(x))
            if self.logit_softcap is not None:
                c = self.logit_softcap
                x = torch.tanh(x / c) * c
        return x


def _check_shared(modules: dict[int, PipelineStageModule], rank_of: Callable[[int], int]) -> None:
    """Refuse parameters held by stages on different ranks (their gradients would need
    summing across ranks)."""
    seen: dict[int, tuple[int, str]] = {}
    for stage, module in modules.items():
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) not in seen:
                seen[id(p)] = (stage, name)
                continue
            other, other_name = seen[id(p)]
            if rank_of(other) == rank_of(stage):
                continue
            if {name, other_name} == {"tok_emb.weight", "lm_head.weight"}:
                raise LlmkitError(
                    f"pipeline parallelism cannot tie the embedding (stage {other}, rank "
                    f"{rank_of(other)}) to the output head (stage {stage}, rank "
                    f"{rank_of(stage)}); set model.tie_embeddings = false"
                )
            raise LlmkitError(
                f"pipeline parallelism: parameter {other_name!r} (stage {other}) is also "
                f"{name!r} (stage {stage}), on another rank; parameters shared across "
                "ranks are not supported"
            )


def build_stages(
    model: nn.Module,
    *,
    pp_rank: int,
    pp_size: int,
    stages_per_rank: int = 1,
    device: torch.device | str = "cpu",
    group: ProcessGroup | None = None,
    layer_ranges: Sequence[range] | None = None,
) -> list[PipelineStage]:
    """This rank's stages of ``model`` as torch ``PipelineStage`` s, in stage order.

    There are ``pp_size · stages_per_rank`` stages, cut by :func:`stage_ranges` unless
    ``layer_ranges`` gives them; rank ``pp_rank`` holds stages ``pp_rank + i · pp_size``
    (loop-style, as interleaved 1F1B expects). Each :class:`PipelineStageModule` is moved to
    ``device``; ``group`` is the pipeline's process group (None: the world).

    The model object is left a shell: every part no stage of this rank holds (other ranks'
    layers, and the embedding or the head) is moved to the meta device, freeing its memory.
    Its structure and names stay, but it can no longer run; train, evaluate and save through
    the stages (``PipelineStage.submod``) or :class:`Pipeline`.
    """
    from torch.distributed.pipelining import PipelineStage

    if pp_size < 1 or stages_per_rank < 1 or not 0 <= pp_rank < pp_size:
        raise LlmkitError(
            f"pipeline: bad placement pp_rank={pp_rank}, pp_size={pp_size}, "
            f"stages_per_rank={stages_per_rank}"
        )
    num_stages = pp_size * stages_per_rank
    ranges = list(layer_ranges) if layer_ranges is not None else stage_ranges(model, num_stages)
    if len(ranges) != num_stages:
        raise LlmkitError(f"pipeline: {len(ranges)} layer ranges for {num_stages} stages")
    modules = {
        s: PipelineStageModule(model, r, is_first=s == 0, is_last=s == num_stages - 1)
        for s, r in enumerate(ranges)
    }
    _check_shared(modules, lambda s: s % pp_size)
    mine = list(range(pp_rank, num_stages, pp_size))
    _drop_unheld(model, [modules[s] for s in mine])
    device = torch.device(device)
    return [PipelineStage(modules[s].to(device), s, num_stages, device, group=group) for s in mine]


def _drop_unheld(model: nn.Module, held: Sequence[PipelineStageModule]) -> None:
    """Move every part of ``model`` that no module of ``held`` registers to the meta device
    (an embedding-only positional scheme a later stage merely calls needs no tensors)."""
    kept: set[int] = set()
    for module in held:
        kept.update(id(t) for t in module.parameters())
        kept.update(id(t) for t in module.buffers())
    parts: list[nn.Module] = list(model.layers) + list(model.layer_positions.values())
    parts += [m for n, m in model.named_children() if n not in ("layers", "layer_positions")]
    for part in parts:
        tensors = [*part.parameters(), *part.buffers()]
        if tensors and not any(id(t) in kept for t in tensors):
            part.to("meta")


# -- running a schedule ------------------------------------------------------------------------
def cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """The model's language-modelling loss: mean cross-entropy over targets not -100."""
    return F.cross_entropy(
        logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100
    )


class Pipeline:
    """A torch pipeline schedule over this rank's stages (:func:`build_stages`).

    ``schedule``: ``"gpipe"`` or ``"1f1b"`` (one stage per rank) or ``"interleaved_1f1b"``
    (one or more). ``loss_fn(logits, targets)`` returns one micro-batch's mean loss.

    Loss contract: :meth:`step` trains (and returns, on the last stage) the mean over
    micro-batches of ``loss_fn`` — the full batch's mean when every micro-batch has the same
    number of trained (not -100) targets. Each micro-batch's loss is scaled by
    ``1 / n_microbatches`` before its backward (torch's own ``scale_grads`` is off: it would
    divide a parameter held by two stages of one rank twice), so gradients equal one process's
    gradients of that mean.
    """

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        schedule: str,
        n_microbatches: int,
        loss_fn: Callable[[Tensor, Tensor], Tensor] = cross_entropy,
    ) -> None:
        from torch.distributed import pipelining

        if schedule not in SCHEDULES:
            raise LlmkitError(
                f"pipeline: unknown schedule {schedule!r} (known: {', '.join(SCHEDULES)})"
            )
        if not stages:
            raise LlmkitError("pipeline: this rank holds no stage")
        if schedule in _SINGLE and len(stages) != 1:
            raise LlmkitError(
                f"pipeline: schedule {schedule!r} runs one stage per rank, not {len(stages)} "
                "(use interleaved_1f1b)"
            )
        if n_microbatches < 1:
            raise LlmkitError(f"pipeline: n_microbatches must be >= 1, not {n_microbatches}")
        self.stages = list(stages)
        self.modules: list[PipelineStageModule] = []
        for stage in self.stages:
            if not isinstance(stage.submod, PipelineStageModule):
                raise LlmkitError("pipeline: stages must wrap PipelineStageModule (build_stages)")
            self.modules.append(stage.submod)
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        cls = getattr(pipelining, SCHEDULES[schedule])
        first = self.stages[0] if schedule in _SINGLE else self.stages
        self.schedule = cls(first, n_microbatches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        if targets.dim() == 1 and targets.dtype == torch.bool:  # forward(): no targets
            return logits.new_zeros(())
        return self.loss_fn(logits, targets) / self.n_microbatches

    @property
    def is_first(self) -> bool:
        """Whether this rank holds the first stage (it reads the token ids)."""
        return any(s.is_first for s in self.stages)

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage (it reads the targets, returns the loss)."""
        return any(s.is_last for s in self.stages)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the model's names, each once."""
        seen: set[int] = set()
        for module in self.modules:
            for name, p in module.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield name, p

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, each once (for its optimizer)."""
        return [p for _, p in self.named_parameters()]

    def train(self, mode: bool = True) -> Pipeline:
        """Set the stage modules' training mode (dropout, activation checkpointing)."""
        for module in self.modules:
            module.train(mode)
        return self

    def _inputs(self, x: Tensor | None, what: str) -> tuple[Tensor, ...]:
        if not self.is_first:
            return ()
        if x is None:
            raise LlmkitError(f"pipeline {what}: the first stage's rank needs the token ids")
        if x.shape[0] % self.n_microbatches:
            raise LlmkitError(
                f"pipeline {what}: batch of {x.shape[0]} rows does not split into "
                f"{self.n_microbatches} equal micro-batches"
            )
        return (x,)

    def step(self, x: Tensor | None, y: Tensor | None) -> Tensor | None:
        """One forward and backward over the batch (token ids ``x``, targets ``y``, both
        (B, T)), split into ``n_microbatches`` equal micro-batches. Gradients accumulate in
        the stage modules' parameters. Returns the mean micro-batch loss (detached) on the
        last stage's rank, None elsewhere. A rank may pass None for what its stages do not
        read (``x`` off the first stage, ``y`` off the last)."""
        args = self._inputs(x, "step")
        if self.is_last and y is None:
            raise LlmkitError("pipeline step: the last stage's rank needs the targets")
        losses: list[Tensor] = []
        target = y if self.is_last else None
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        if not self.is_last:
            return None
        return torch.stack([loss.detach() for loss in losses]).sum()

    def _local(self, x: Tensor) -> list[Tensor]:
        """Every stage on this rank (a pipeline of one rank): the micro-batches' logits,
        computed by calling the stages in order. Torch's ``eval()`` fails on two adjacent
        stages of one rank (it runs their backward hand-off without a backward)."""
        outputs = []
        for h in x.chunk(self.n_microbatches):
            for module in self.modules:
                h = module(h)
            outputs.append(h)
        return outputs

    @torch.no_grad()
    def forward(self, x: Tensor | None) -> Tensor | None:
        """The logits (B, T, V) of token ids ``x`` on the last stage's rank, None elsewhere;
        no backward. The first and the last stage's ranks need ``x`` (the last reads only its
        batch size)."""
        args = self._inputs(x, "forward")
        if self.is_first and self.is_last:
            return torch.cat(self._local(args[0]))
        target = None
        if self.is_last:
            if x is None:
                raise LlmkitError("pipeline forward: the last stage's rank needs the batch")
            target = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
        return self.schedule.eval(*args, target=target)

    @torch.no_grad()
    def evaluate(self, x: Tensor | None, y: Tensor | None) -> Tensor | None:
        """The mean micro-batch loss of a batch without backward (as :meth:`step` reports
        it) on the last stage's rank, None elsewhere."""
        args = self._inputs(x, "evaluate")
        if self.is_last and y is None:
            raise LlmkitError("pipeline evaluate: the last stage's rank needs the targets")
        if self.is_first and self.is_last:
            assert y is not None
            logits = self._local(args[0])
            targets = y.chunk(self.n_microbatches)
            return torch.stack(
                [self._loss(o, t) for o, t in zip(logits, targets, strict=True)]
            ).sum()
        losses: list[Tensor] = []
        self.schedule.eval(*args, target=y if self.is_last else None, losses=losses)
        return torch.stack(losses).sum() if self.is_last else None
