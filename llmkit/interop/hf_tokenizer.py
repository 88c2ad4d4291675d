"""Hugging Face tokenizers into llmkit runs and out again.

* :func:`read_hf_tokenizer` — a local Hugging Face checkpoint's tokenizer as tokenizer.json
  text plus the part of its ``tokenizer_config.json`` llmkit keeps (chat template, token
  roles). A fast ``tokenizer.json`` is read as it is; legacy files (GPT-2 ``vocab.json`` +
  ``merges.txt``, SentencePiece ``tokenizer.model``, WordPiece ``vocab.txt``) are converted
  locally by ``transformers`` (SentencePiece needs the ``sentencepiece`` and ``protobuf``
  packages).
* :func:`write_run_tokenizer` — those files into an llmkit run directory.
* :func:`write_hf_tokenizer` — a run's tokenizer as files ``transformers.AutoTokenizer``
  loads with no custom code (``PreTrainedTokenizerFast``).

Ids agree with ``transformers`` for text encoded **without special tokens**
(``add_special_tokens=False``): llmkit never adds BOS/EOS itself. A model trained with a BOS
in front of every sequence (``HFTokenizerFiles.adds_bos``) needs the caller to prepend
``bos_token``'s id.

Role tokens (eos/bos/pad/unk) are declared to ``transformers`` only when they are added
tokens of tokenizer.json: ``transformers`` turns a declared token into an added token, which
would make the token's literal text in the input encode as that one id where llmkit splits
it. So a char tokenizer's ``<unk>`` (a vocabulary entry, not an added token) is left
undeclared: unknown characters still get its id, but ``AutoTokenizer``'s ``unk_token`` is
None.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmkit.data.tokenizer import CONFIG_FILE, Tokenizer
from llmkit.errors import LlmkitError, first_line
from llmkit.files import parse_json
from llmkit.interop import local_files

if TYPE_CHECKING:
    import tokenizers

TOKENIZER_FILE = "tokenizer.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
#: Where newer ``transformers`` versions save the chat template (beside the config).
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
#: Legacy vocabulary files, each set converted by ``transformers``: GPT-2 byte-level BPE,
#: SentencePiece, WordPiece.
LEGACY_FILES = (("vocab.json", "merges.txt"), ("tokenizer.model",), ("vocab.txt",))
SENTENCEPIECE_FILE = "tokenizer.model"
#: The token roles a tokenizer config declares, EOS first.
ROLES = ("eos_token", "bos_token", "pad_token", "unk_token")
#: Boolean flags of a tokenizer config that llmkit keeps.
FLAGS = ("add_bos_token", "add_eos_token")
HF_CLASS = "PreTrainedTokenizerFast"


@dataclass
class HFTokenizerFiles:
    """A Hugging Face tokenizer as llmkit keeps it.

    ``config`` holds the kept part of ``tokenizer_config.json``: ``chat_template``, the role
    tokens (plain strings, only those the vocabulary holds) and ``add_bos_token`` /
    ``add_eos_token`` when given. ``special_tokens`` lists the EOS first (when known), then
    the other role tokens, the config's additional special tokens and tokenizer.json's
    special added tokens in id order — a spec's ``tokenizer.special_tokens``. ``adds_bos``:
    whether ``transformers`` puts ``bos_token`` in front of encoded text by default (llmkit
    does not). ``source``: the file(s) the vocabulary came from.
    """

    tokenizer_json: str
    config: dict[str, Any]
    special_tokens: list[str]
    eos_token: str | None = None
    bos_token: str | None = None
    adds_bos: bool = False
    source: str = TOKENIZER_FILE
    #: How many ids the tokenizer can give (the highest + 1), added tokens included.
    n_ids: int = 0

    @property
    def chat_template(self) -> str | None:
        return self.config.get("chat_template")

    @property
    def kind(self) -> str:
        """llmkit's kind of this tokenizer: ``bpe``, ``char`` or ``pretrained``."""
        return Tokenizer.from_str(self.tokenizer_json).kind


# -- reading ----------------------------------------------------------------------------------


def read_hf_tokenizer(hf_dir: Path) -> HFTokenizerFiles | None:
    """The tokenizer of the Hugging Face checkpoint directory ``hf_dir``: its tokenizer.json,
    else its legacy vocabulary files converted locally by ``transformers``; None when it has
    no tokenizer files at all. Malformed files raise a one-line :class:`LlmkitError`
    naming the file."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise LlmkitError(f"{hf_dir}: not a directory")
    config = _checkpoint_object(hf_dir, CONFIG_FILE)
    token_map = _checkpoint_object(hf_dir, SPECIAL_TOKENS_MAP)
    path = hf_dir / TOKENIZER_FILE
    roles = _file_roles(hf_dir, config, token_map)
    if path.is_file():
        text, tok = _read_tokenizer_json(path, local_files.inside(hf_dir, TOKENIZER_FILE))
        return _files(text, tok, config, roles, TOKENIZER_FILE)
    legacy = _legacy_files(hf_dir)
    if legacy is None:
        if (hf_dir / CONFIG_FILE).is_file():
            raise LlmkitError(
                f"{hf_dir / CONFIG_FILE}: no vocabulary beside it (tokenizer.json, "
                "vocab.json + merges.txt, tokenizer.model or vocab.txt)"
            )
        return None
    _check_for_transformers(hf_dir, config)
    hf_tok = _convert_legacy(hf_dir, legacy)
    text = hf_tok.backend_tokenizer.to_str()
    tok = _parse(text, hf_dir / legacy[0])
    return _files(text, tok, config, _object_roles(hf_tok, roles), " + ".join(legacy))


def _files(
    text: str,
    tok: tokenizers.Tokenizer,
    config: dict[str, Any],
    roles: dict[str, Any],
    source: str,
) -> HFTokenizerFiles:
    """Assemble :class:`HFTokenizerFiles`, dropping role tokens the vocabulary lacks."""
    known = {k: v for k, v in roles.items() if k in ROLES and _in_vocab(tok, v)}
    kept: dict[str, Any] = {}
    if roles.get("chat_template"):
        kept["chat_template"] = roles["chat_template"]
    kept.update(known)
    kept.update({k: config[k] for k in FLAGS if isinstance(config.get(k), bool)})
    added = [t.content for _, t in sorted(tok.get_added_tokens_decoder().items()) if t.special]
    extra = [t for t in roles.get("additional", []) if _in_vocab(tok, t)]
    specials = list(dict.fromkeys([*(known[r] for r in ROLES if r in known), *extra, *added]))
    bos = known.get("bos_token")
    flag = config.get("add_bos_token")
    adds_bos = flag if isinstance(flag, bool) else _post_processor_adds(text, bos)
    ids = tok.get_vocab(with_added_tokens=True).values()
    n_ids = max(tok.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)
    return HFTokenizerFiles(
        tokenizer_json=text,
        config=kept,
        special_tokens=specials,
        eos_token=known.get("eos_token"),
        bos_token=bos,
        adds_bos=bool(adds_bos and bos),
        source=source,
        n_ids=n_ids,
    )


def _read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file's object (bounded in size and depth); {} when there is no file."""
    return local_files.read_object(path) or {}


def _checkpoint_object(hf_dir: Path, name: str) -> dict[str, Any]:
    """The JSON object of the checkpoint's file ``name``, which must lie inside it; {} when
    there is no such file."""
    return local_files.checkpoint_object(hf_dir, name) or {}


def _read_tokenizer_json(path: Path, real: Path | None = None) -> tuple[str, tokenizers.Tokenizer]:
    """tokenizer.json's text (read at ``real``, its resolved path, when given), and the
    tokenizer ``tokenizers`` reads from it."""
    try:
        text = (real or path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LlmkitError(f"{path}: cannot read it ({first_line(exc)})") from exc
    return text, _parse(text, path)


def _check_for_transformers(hf_dir: Path, config: dict[str, Any]) -> None:
    """Before ``transformers`` converts legacy files (opening what it finds by itself):
    every entry of the directory stays inside it, and no ``*_file`` setting of
    tokenizer_config.json names a path outside it (older transformers open those as
    given)."""
    local_files.check_tree(hf_dir)
    for key, value in config.items():
        if key.endswith(("_file", "_files")) and value is not None:
            values = value if isinstance(value, list) else [value]
            for v in values:
                local_files.inside(hf_dir, v, f"{hf_dir / CONFIG_FILE}: {key}")


def _parse(text: str, path: Path) -> tokenizers.Tokenizer:
    from tokenizers import Tokenizer as RawTokenizer

    try:
        return RawTokenizer.from_str(text)
    except Exception as exc:
        raise LlmkitError(f"{path}: not a valid tokenizer.json ({first_line(exc)})") from exc


def _file_roles(hf_dir: Path, config: dict[str, Any], token_map: dict[str, Any]) -> dict[str, Any]:
    """Role tokens, additional special tokens and chat template of the config files
    (``tokenizer_config.json`` first, then ``special_tokens_map.json``)."""
    config_path, map_path = hf_dir / CONFIG_FILE, hf_dir / SPECIAL_TOKENS_MAP
    roles: dict[str, Any] = {}
    for role in ROLES:
        value = _token(config.get(role), config_path, role)
        roles[role] = value or _token(token_map.get(role), map_path, role)
    extra = _token_list(config, config_path) + _token_list(token_map, map_path)
    roles["additional"] = list(dict.fromkeys(extra))
    roles["chat_template"] = _chat_template(hf_dir, config)
    return roles


def _token(value: Any, path: Path, name: str) -> str | None:
    """A config's token: a string or a serialized AddedToken (``{"content": ...}``)."""
    if isinstance(value, dict):
        value = value.get("content")
    if value is None or isinstance(value, str):
        return value or None
    raise LlmkitError(f"{path}: {name} must be a string or an AddedToken object")


def _token_list(data: dict[str, Any], path: Path) -> list[str]:
    """``additional_special_tokens`` (``extra_special_tokens`` in transformers 5: a list,
    or a dict from names to tokens)."""
    out: list[str] = []
    for key in ("additional_special_tokens", "extra_special_tokens"):
        value = data.get(key) or []
        items = list(value.values()) if isinstance(value, dict) else value
        if not isinstance(items, list):
            raise LlmkitError(f"{path}: {key} must be a list of tokens")
        out.extend(t for t in (_token(v, path, key) for v in items) if t)
    return out


def _chat_template(hf_dir: Path, config: dict[str, Any]) -> str | None:
    """The chat template: the config's (a string, or the ``default`` of named ones), else
    ``chat_template.jinja``, else ``chat_template.json``'s."""
    path = hf_dir / CONFIG_FILE
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    if template is None and (hf_dir / CHAT_TEMPLATE_FILES[0]).is_file():
        path = hf_dir / CHAT_TEMPLATE_FILES[0]
        real = local_files.inside(hf_dir, CHAT_TEMPLATE_FILES[0])
        try:
            template = real.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise LlmkitError(f"{path}: cannot read it ({first_line(exc)})") from exc
    if template is None and (hf_dir / CHAT_TEMPLATE_FILES[1]).is_file():
        path = hf_dir / CHAT_TEMPLATE_FILES[1]
        template = _checkpoint_object(hf_dir, CHAT_TEMPLATE_FILES[1]).get("chat_template")
    if template is not None and not isinstance(template, str):
        raise LlmkitError(f"{path}: chat_template must be a string")
    return template or None


def _in_vocab(tok: tokenizers.Tokenizer, token: Any) -> bool:
    return isinstance(token, str) and tok.token_to_id(token) is not None


def _post_processor_adds(text: str, bos: str | None) -> bool:
    """Whether tokenizer.json's post-processor puts ``bos`` first in a single sequence."""
    if bos is None:
        return False
    proc = parse_json(text, TOKENIZER_FILE).get("post_processor") or {}
    procs = proc.get("processors", [proc]) if proc.get("type") == "Sequence" else [proc]
    for p in procs:
        if p.get("type") == "TemplateProcessing" and p.get("single"):
            first = p["single"][0]
            return first.get("SpecialToken", {}).get("id") == bos
        if p.get("type") in ("BertProcessing", "RobertaProcessing"):
            return (p.get("cls") or [None])[0] == bos
    return False


# -- legacy files -----------------------------------------------------------------------------


def _legacy_files(hf_dir: Path) -> tuple[str, ...] | None:
    """The first complete set of legacy vocabulary files in ``hf_dir``, or None; a
    ``vocab.json`` without ``merges.txt`` is an error."""
    for names in LEGACY_FILES:
        if all((hf_dir / n).is_file() for n in names):
            return names
    if (hf_dir / "vocab.json").is_file():
        raise LlmkitError(f"{hf_dir / 'vocab.json'}: a BPE vocabulary needs merges.txt beside it")
    return None


def _convert_legacy(hf_dir: Path, names: tuple[str, ...]) -> Any:
    """A fast ``transformers`` tokenizer built from legacy files, offline: the class the
    directory's configs name (``AutoTokenizer``), else GPT-2's for vocab.json + merges.txt."""
    path = hf_dir / names[0]
    transformers = _require_transformers(path)
    if names[0] == SENTENCEPIECE_FILE:
        _require_sentencepiece(path)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(
            hf_dir, local_files_only=True, trust_remote_code=False
        )
    except ImportError as exc:
        raise _missing(path, getattr(exc, "name", None) or first_line(exc)) from exc
    except Exception as exc:
        if names[0] != "vocab.json":
            raise LlmkitError(f"{path}: cannot convert it ({first_line(exc)})") from exc
        tok = _gpt2(transformers, hf_dir, path)
    if getattr(tok, "backend_tokenizer", None) is None:  # a slow (Python) tokenizer
        tok = _to_fast(transformers, tok, path)
    return tok


def _gpt2(transformers: Any, hf_dir: Path, path: Path) -> Any:
    try:
        return transformers.GPT2TokenizerFast.from_pretrained(hf_dir, local_files_only=True)
    except Exception as exc:
        raise LlmkitError(f"{path}: cannot convert it ({first_line(exc)})") from exc


def _to_fast(transformers: Any, slow: Any, path: Path) -> Any:
    """A fast tokenizer around ``convert_slow_tokenizer``'s backend, roles kept."""
    from transformers.convert_slow_tokenizer import convert_slow_tokenizer

    try:
        backend = convert_slow_tokenizer(slow)
    except ImportError as exc:
        raise _missing(path, getattr(exc, "name", None) or first_line(exc)) from exc
    except Exception as exc:
        raise LlmkitError(f"{path}: cannot convert it ({first_line(exc)})") from exc
    roles = {r: getattr(slow, r, None) for r in ROLES}
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, **{k: str(v) for k, v in roles.items() if v}
    )
    fast.chat_template = getattr(slow, "chat_template", None)
    return fast


def _object_roles(hf_tok: Any, from_files: dict[str, Any]) -> dict[str, Any]:
    """Role tokens and chat template of a ``transformers`` tokenizer (which has merged the
    config files and its class's defaults), the files' where it has none."""
    roles = dict(from_files)
    for role in ROLES:
        value = getattr(hf_tok, role, None)
        if value:
            roles[role] = str(value)
    template = getattr(hf_tok, "chat_template", None)
    if isinstance(template, str) and template:
        roles["chat_template"] = template
    return roles


def _require_transformers(path: Path) -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise _missing(path, "transformers") from exc
    return transformers


def _require_sentencepiece(path: Path) -> None:
    """A SentencePiece model needs ``sentencepiece`` and ``protobuf`` to convert (a tiktoken
    file saved as tokenizer.model needs ``tiktoken`` instead)."""
    from transformers import utils

    is_sentencepiece_available = utils.is_sentencepiece_available
    is_protobuf_available = utils.is_protobuf_available
    tiktoken = getattr(utils, "is_tiktoken_available", lambda: False)  # transformers >= 4.45
    if tiktoken() and not is_sentencepiece_available():
        return
    for package, available in (
        ("sentencepiece", is_sentencepiece_available),
        ("protobuf", is_protobuf_available),
    ):
        if not available():
            raise _missing(path, package)


def _missing(path: Path, package: str) -> LlmkitError:
    return LlmkitError(
        f"{path}: converting it to tokenizer.json needs the {package} package, which is not "
        f"installed (pip install {package}, or give a directory with a tokenizer.json)"
    )


# -- writing ----------------------------------------------------------------------------------


def write_run_tokenizer(files: HFTokenizerFiles, run_dir: Path) -> None:
    """Write ``files`` into the run directory ``run_dir``: tokenizer.json, and a
    ``tokenizer_config.json`` when there is a chat template, an EOS or a BOS (its
    ``eos_token`` is what llmkit reads as the end of turn). ``Tokenizer.load`` then encodes
    as ``transformers`` does with ``add_special_tokens=False``; llmkit adds no BOS, so a
    caller whose model expects one (``files.adds_bos``) prepends ``files.bos_token``."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / TOKENIZER_FILE).write_text(files.tokenizer_json, encoding="utf-8")
    path = run_dir / CONFIG_FILE
    if not any(files.config.get(k) for k in ("chat_template", "eos_token", "bos_token")):
        path.unlink(missing_ok=True)  # a stale one would describe another tokenizer
        return
    config = {"tokenizer_class": HF_CLASS, **files.config, "clean_up_tokenization_spaces": False}
    _write_json(path, config)


def write_hf_tokenizer(
    run_dir: Path,
    out_dir: Path,
    *,
    eos_token: str | None,
    bos_token: str | None = None,
    model_max_length: int | None = None,
) -> list[str]:
    """Write the run's tokenizer into ``out_dir`` for ``transformers.AutoTokenizer`` (no
    custom code): :func:`hf_tokenizer_files`, all read and checked before anything is
    written. Returns the names of the files written."""
    files = hf_tokenizer_files(
        run_dir, eos_token=eos_token, bos_token=bos_token, model_max_length=model_max_length
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out_dir / name).write_text(text, encoding="utf-8")
    return list(files)


def hf_tokenizer_files(
    run_dir: Path,
    *,
    eos_token: str | None,
    bos_token: str | None = None,
    model_max_length: int | None = None,
) -> dict[str, str]:
    """The run's tokenizer as the files ``transformers.AutoTokenizer`` loads (no custom
    code), by name: tokenizer.json as it is, ``tokenizer_config.json`` and
    ``special_tokens_map.json``. Nothing is written: a malformed run file is an error
    before any output exists.

    ``eos_token`` is the run's EOS (the spec's first special token; None: llmkit's default,
    the lowest-id special token). The config's ``eos_token`` is the run's end of turn when
    it has a chat template config (as llmkit's own ``tokenizer_config.json``), else the EOS;
    ``pad_token`` the run config's, else the EOS; ``bos_token`` the argument, else the run
    config's; ``unk_token`` the run config's, else the model's. Char
    tokenizers export too, with the same ids (``<unk>`` is not declared: see the module
    docstring).
    """
    run_dir = Path(run_dir)
    src = run_dir / TOKENIZER_FILE
    if not src.is_file():
        raise LlmkitError(f"{src}: not found (the run has no tokenizer to export)")
    run_config = _read_json_object(run_dir / CONFIG_FILE)  # bounded, before Tokenizer.load
    tok = Tokenizer.load(src, eos_token=eos_token)
    roles = _export_roles(tok, run_config, run_dir / CONFIG_FILE, bos_token)
    config: dict[str, Any] = {"tokenizer_class": HF_CLASS, **roles}
    config.update({k: run_config[k] for k in FLAGS if isinstance(run_config.get(k), bool)})
    if tok.chat_template:
        config["chat_template"] = tok.chat_template
    if model_max_length is not None:
        config["model_max_length"] = int(model_max_length)
    config["clean_up_tokenization_spaces"] = False
    try:
        text = src.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LlmkitError(f"{src}: cannot read it ({first_line(exc)})") from exc
    return {
        TOKENIZER_FILE: text,
        CONFIG_FILE: _json_text(config),
        SPECIAL_TOKENS_MAP: _json_text(roles),
    }


def _export_roles(
    tok: Tokenizer, run_config: dict[str, Any], path: Path, bos_token: str | None
) -> dict[str, str]:
    """The role tokens to declare: those that are added tokens of the tokenizer."""
    unk = _token(run_config.get("unk_token"), path, "unk_token")
    model_unk = getattr(tok.tok.model, "unk_token", None)
    roles = {
        "eos_token": tok.end_of_turn or tok.eos_token,
        "bos_token": bos_token or tok.bos_token,
        "pad_token": _token(run_config.get("pad_token"), path, "pad_token") or tok.eos_token,
        "unk_token": unk or (model_unk if isinstance(model_unk, str) else None),
    }
    added = {t.content for t in tok.tok.get_added_tokens_decoder().values()}
    return {k: v for k, v in roles.items() if v and v in added}


def _json_text(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(_json_text(data), encoding="utf-8")
