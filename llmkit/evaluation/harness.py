"""llmkit runs as an lm-eval-harness model: ``llmkit lm-eval --model llmkit --model_args
run=RUN --tasks ...``.

lm-eval-harness finds its models in a registry of its own, without plugin discovery, so the
model is known to it once this module is imported: importing it registers :class:`LlmkitLM`
under the name ``llmkit`` (again importing, or calling :func:`register`, does nothing more).
lm-eval's own ``lm_eval`` command therefore does not know it; :func:`main` (``llmkit
lm-eval ...``) registers it and runs lm-eval's command line with the same arguments.

The model arguments (``--model_args key=value,...``):

- ``run``: a run directory or one of its checkpoint directories (required);
- ``weights``: ``final`` (default), ``best`` or ``latest``;
- ``batch_size``: rows per forward (default 16; ``auto`` means the default, or
  ``max_batch_size`` when given);
- ``device``: ``cpu`` (default), ``cuda``, ``cuda:N``, ``mps`` or ``auto``;
- ``max_length``: tokens one forward sees (default: the model's ``max_seq_len``);
- ``max_gen_toks``: ``generate_until``'s default number of new tokens (256, lm-eval's).

``batch_size``, ``max_batch_size`` and ``device`` may also come from lm-eval's own options
(``--batch_size``, ``--max_batch_size``, ``--device``); a value in ``--model_args`` wins.
lm-eval's command line always passes them: ``--batch_size`` 1 and ``--device cuda:0`` unless
told otherwise. Without a CUDA GPU that default device falls back to the CPU, while a
``device`` named in ``--model_args`` must exist.

Scores are llmkit's own: ``loglikelihood`` is
:meth:`~llmkit.evaluation.loglik.LoglikScorer.loglikelihood` (tokenized as lm-eval does, one
batched call, shared contexts through the KV cache), ``loglikelihood_rolling`` is
:meth:`~llmkit.evaluation.loglik.LoglikScorer.rolling`, and ``generate_until`` is
:class:`~llmkit.inference.Generator`'s (greedy unless ``do_sample`` with a temperature > 0).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmkit.errors import LlmkitError

try:
    import lm_eval  # noqa: F401
    from lm_eval.api.model import LM
except ImportError:
    raise LlmkitError(
        "the lm-eval-harness adapter needs the lm-eval extra: pip install 'llmkit[lm-eval]'"
    ) from None

log = logging.getLogger(__name__)

#: The name lm-eval knows llmkit runs by (``--model llmkit``).
MODEL_NAME = "llmkit"
#: Which weights of a run (``weights=``): see :meth:`llmkit.runs.Run.weights`.
WEIGHTS = ("final", "best", "latest")
DEFAULT_BATCH_SIZE = 16
#: The model arguments :class:`LlmkitLM` takes.
MODEL_ARGS = (
    "run",
    "weights",
    "batch_size",
    "max_batch_size",
    "device",
    "max_length",
    "max_gen_toks",
)
#: ``generate_until``'s number of new tokens when a task does not say (lm-eval's default).
DEFAULT_MAX_GEN_TOKS = 256


def _int_arg(name: str, value: Any, minimum: int = 1) -> int:
    """A model argument that must be an integer ≥ ``minimum`` (lm-eval passes strings)."""
    try:
        number = int(str(value).strip())
    except ValueError:
        raise LlmkitError(f"lm-eval model argument {name}: not an integer: {value!r}") from None
    if number < minimum:
        raise LlmkitError(f"lm-eval model argument {name}: must be ≥ {minimum}, got {number}")
    return number


def _batch_size(value: Any, max_batch_size: Any) -> int:
    """An integer batch size; ``auto`` / ``auto:N`` (lm-eval's search for the largest batch
    that fits) is ``max_batch_size`` when given, else the default."""
    if isinstance(value, str) and value.strip().lower().startswith("auto"):
        if max_batch_size is None:
            return DEFAULT_BATCH_SIZE
        return _int_arg("max_batch_size", max_batch_size)
    return _int_arg("batch_size", value)


def _device(requested: Any) -> Any:
    """The torch device named by ``requested`` (``auto`` picks one), checked to exist."""
    from llmkit import hardware

    try:
        return hardware.choose_device(str(requested))
    except LlmkitError:
        raise LlmkitError(
            f"lm-eval model argument device: {requested!r} is not a device available here"
        ) from None


def _device_usable(requested: Any) -> bool:
    """Whether a device lm-eval's options ask for exists here."""
    try:
        _device(requested)
    except LlmkitError:
        return False
    return True


class LlmkitLM(LM):
    """An llmkit run (a run or checkpoint directory) as an lm-eval-harness ``LM``; the
    arguments are the module docstring's (strings, as ``--model_args`` gives them)."""

    def __init__(
        self,
        run: str | Path | None = None,
        weights: str = "final",
        batch_size: int | str = DEFAULT_BATCH_SIZE,
        max_batch_size: int | str | None = None,
        device: str = "cpu",
        max_length: int | str | None = None,
        max_gen_toks: int | str = DEFAULT_MAX_GEN_TOKS,
    ) -> None:
        super().__init__()
        from llmkit.evaluation.loglik import LoglikScorer
        from llmkit.inference import Generator
        from llmkit.runs import load_run

        if run is None or not str(run).strip():
            raise LlmkitError("lm-eval model argument run is required: --model_args run=RUN_DIR")
        if str(weights) not in WEIGHTS:
            raise LlmkitError(
                f"lm-eval model argument weights: {weights!r} is not one of {', '.join(WEIGHTS)}"
            )
        self.batch_size = _batch_size(batch_size, max_batch_size)
        self.max_gen_toks = _int_arg("max_gen_toks", max_gen_toks, minimum=0)
        self._device = _device(device)
        loaded = load_run(str(run), which=str(weights), device=str(self._device))
        self.run = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        context = int(self.model.config.max_seq_len)
        length = context if max_length is None else _int_arg("max_length", max_length)
        if length > context:
            raise LlmkitError(
                f"lm-eval model argument max_length: {length} is longer than the model's "
                f"context ({context} tokens)"
            )
        self.max_length = length
        self.scorer = LoglikScorer(
            self.model, self.tokenizer, batch_size=self.batch_size, max_length=length
        )
        self.generator = Generator(self.model, self.tokenizer)

    # -- construction from lm-eval's arguments -----------------------------------------

    @classmethod
    def create_from_arg_string(
        cls, arg_string: str, additional_config: dict[str, Any] | None = None
    ) -> LlmkitLM:
        """The model of ``--model_args`` ``key=value,...`` and lm-eval's own options."""
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(
        cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None
    ) -> LlmkitLM:
        """The model of ``arg_dict`` (the model arguments) and lm-eval's own options
        (``batch_size``, ``max_batch_size``, ``device``), the model arguments winning; a
        device lm-eval asks for that does not exist here (its ``cuda:0`` default on a
        machine without CUDA) leaves the model on the CPU."""
        args = dict(arg_dict)
        allowed = set(MODEL_ARGS)
        unknown = sorted(set(args) - allowed)
        if unknown:
            raise LlmkitError(
                f"unknown lm-eval model argument(s) for llmkit: {', '.join(unknown)} (known: "
                f"{', '.join(sorted(allowed))})"
            )
        for key, value in (additional_config or {}).items():
            if value is None or key in args or key not in allowed:
                continue
            if key == "device" and not _device_usable(value):
                log.info("lm-eval asked for device %s, not available here: using the CPU", value)
                continue
            args[key] = value
        return cls(**args)

    # -- lm-eval's interface -----------------------------------------------------------

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval records in its results' ``config``."""
        return {
            "llmkit_run": str(self.run.run_dir),
            "llmkit_weights": str(self.run.weights),
            "max_length": self.max_length,
        }

    def loglikelihood(
        self, requests: Sequence[Any], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        """``(log-probability, greedy)`` of each request's ``(context, continuation)``, all
        scored in one batched call."""
        if not requests:
            return []
        pairs = [(str(r.args[0]), str(r.args[1])) for r in requests]
        try:
            scores = self.scorer.loglikelihood(pairs)
        except ValueError as exc:
            raise LlmkitError(f"lm-eval loglikelihood: {exc}") from exc
        out = []
        for req, score in zip(requests, scores, strict=True):
            result = (score.logprob, score.greedy)
            self.cache_hook.add_partial("loglikelihood", req.args, result)
            out.append(result)
        return out

    def loglikelihood_rolling(
        self, requests: Sequence[Any], disable_tqdm: bool = False
    ) -> list[float]:
        """The log-probability of each request's whole text, every token scored once from
        the document start (the tokenizer's EOS) in windows of ``max_length``; an empty text
        scores 0, as in lm-eval."""
        from llmkit.data.long_text import encode_long

        out = []
        for req in requests:
            ids = encode_long(self.tokenizer, str(req.args[0]))  # any length, int32 ids
            logprob = self.scorer.rolling(ids).logprob if len(ids) else 0.0
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, logprob)
            out.append(logprob)
        return out

    def generate_until(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[str]:
        """The continuation of each request's context, generated until one of its ``until``
        strings (excluded) or the EOS, or ``max_gen_toks`` tokens; requests with the same
        generation arguments are batched, the results in the requests' order."""
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            key = json.dumps(req.args[1] or {}, sort_keys=True, default=str)
            groups.setdefault(key, []).append(i)
        out: list[str | None] = [None] * len(requests)
        for index in groups.values():
            settings = self._sampling(requests[index[0]].args[1] or {})
            keep = self._prompt_tokens(settings["max_new_tokens"])
            for start in range(0, len(index), self.batch_size):
                part = index[start : start + self.batch_size]
                prompts = [self._prompt(str(requests[i].args[0]), keep) for i in part]
                try:
                    results = self.generator.generate(prompts, **settings)
                except ValueError as exc:
                    raise LlmkitError(f"lm-eval generate_until: {exc}") from exc
                for i, result in zip(part, results, strict=True):
                    out[i] = result.text
                    self.cache_hook.add_partial("generate_until", requests[i].args, result.text)
        return [text or "" for text in out]

    # -- generation helpers --------------------------------------------------------------

    def _sampling(self, gen_kwargs: dict[str, Any]) -> dict[str, Any]:
        """:class:`~llmkit.inference.Sampling` fields from lm-eval's generation arguments:
        ``until`` (a string or a list; the EOS text added, as lm-eval's models do),
        ``max_gen_toks``, ``do_sample``, ``temperature``, ``top_p``, ``top_k``. Greedy unless
        ``do_sample`` is true and the temperature (default 1) above 0."""
        until = gen_kwargs.get("until")
        if until is None:
            until = []
        elif isinstance(until, str):
            until = [until]
        elif not isinstance(until, list | tuple):
            raise LlmkitError(
                f"lm-eval generate_until: until must be a string or a list: {until!r}"
            )
        stops = list(dict.fromkeys(str(s) for s in until if s))
        eos = getattr(self.tokenizer, "eos_token", None)
        if eos and eos not in stops:
            stops.append(eos)
        max_new = gen_kwargs.get("max_gen_toks", self.max_gen_toks)
        settings: dict[str, Any] = {
            "max_new_tokens": _int_arg("max_gen_toks", max_new, minimum=0),
            "stop": stops,
            "temperature": 0.0,
        }
        try:
            temperature = float(gen_kwargs.get("temperature", 1.0) or 0.0)
        except (TypeError, ValueError):
            raise LlmkitError(
                f"lm-eval generate_until: temperature is not a number: "
                f"{gen_kwargs.get('temperature')!r}"
            ) from None
        if gen_kwargs.get("do_sample") and temperature > 0:
            settings["temperature"] = temperature
            for key in ("top_p", "top_k"):
                if gen_kwargs.get(key) is not None:
                    settings[key] = gen_kwargs[key]
        ignored = set(gen_kwargs) - {"until", "max_gen_toks", "do_sample", "temperature"}
        ignored -= {"top_p", "top_k"}
        if ignored:
            log.debug("generate_until ignores %s", ", ".join(sorted(ignored)))
        return settings

    def _prompt_tokens(self, max_new_tokens: int) -> int:
        """How many of a prompt's last tokens generation keeps: room for ``max_new_tokens``
        within ``max_length`` (lm-eval's rule), but never less than half of ``max_length``
        (a longer generation slides the model's context, see
        :class:`~llmkit.inference.decode.DecodeContext`)."""
        return max(self.max_length - max_new_tokens, self.max_length // 2, 1)

    def _prompt(self, context: str, keep: int) -> list[int]:
        """The last ``keep`` token ids of ``context`` (empty: the generator starts it from
        the EOS)."""
        from llmkit.data.long_text import encode_long

        ids = encode_long(self.tokenizer, context).tolist() if context else []
        return ids[-keep:]


def register() -> None:
    """Make ``llmkit`` a model name lm-eval knows (importing this module does it); calling
    it again does nothing."""
    import lm_eval.models  # noqa: F401  (lm-eval lists its own models only into an empty registry)
    from lm_eval.api.registry import model_registry, register_model

    if MODEL_NAME in model_registry and model_registry.get(MODEL_NAME) is LlmkitLM:
        return
    try:
        register_model(MODEL_NAME)(LlmkitLM)
    except ValueError as exc:  # another class holds the name
        raise LlmkitError(f"lm-eval already has a model named {MODEL_NAME!r}: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run lm-eval's command line (``lm_eval [run] --model llmkit ...``) with ``argv``
    (default: this process's arguments), the ``llmkit`` model registered; its exit status."""
    from lm_eval.__main__ import cli_evaluate

    register()
    args = list(sys.argv[1:] if argv is None else argv)
    saved = sys.argv
    sys.argv = ["lm-eval", *args]  # lm-eval's parser reads sys.argv only
    try:
        cli_evaluate()
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return int(exc.code or 0)
        print(exc.code, file=sys.stderr)
        return 1
    finally:
        sys.argv = saved
    return 0


register()
