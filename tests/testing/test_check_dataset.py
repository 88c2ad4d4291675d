"""llmkit.testing's dataset check: the built-in sources pass with small files, and sources
that break the contract fail naming the property."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmkit.contracts import ComponentOptions
from llmkit.errors import LlmkitError
from llmkit.registry import get_registry
from llmkit.testing import check_component
from tests.testing.fakes import fake

DOCS = [f"document {i}: " + "lorem ipsum " * (i + 1) for i in range(20)]


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _options(name: str, tmp: Path) -> dict[str, Any]:
    """Small options for the built-in source ``name``, its files written under ``tmp``."""
    if name == "python-stdlib":
        return {"max_files": 20}
    if name == "text":
        for i, doc in enumerate(DOCS[:4]):
            (tmp / f"d{i}.txt").write_text(doc * 5, encoding="utf-8")
        return {"paths": [str(tmp / "*.txt")]}
    if name == "jsonl":
        path = _jsonl(tmp / "docs.jsonl", [{"text": d} for d in DOCS])
        return {"paths": [path], "cache_dir": str(tmp / "hf")}
    if name == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": DOCS}), tmp / "docs.parquet")
        return {"paths": [str(tmp / "docs.parquet")], "cache_dir": str(tmp / "hf")}
    if name == "saved":
        import datasets

        datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp / "saved"))
        return {"path": str(tmp / "saved")}
    if name == "chat":
        rows = [{"prompt": f"question {i}?", "response": f"answer {i}."} for i in range(10)]
        return {"paths": [_jsonl(tmp / "chat.jsonl", rows)]}
    if name == "tokens":  # a token store, decoded back into its documents
        from tests.data.test_shards import make_store

        return {"path": str(make_store(tmp, DOCS))}
    raise AssertionError(f"no sample options for dataset {name!r}; add some here")


BUILTINS = [c.name for c in get_registry().list("dataset") if c.provider == "llmkit"]


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_sources_pass_with_small_files(name, tmp_path):
    check_component(get_registry().get("dataset", name), _options(name, tmp_path))


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_sources_without_options_get_the_generic_part(name):
    check_component(get_registry().get("dataset", name))  # needing paths is not a failure


def test_options_that_do_not_work_fail(tmp_path):
    with pytest.raises(AssertionError, match=r"splits\(0\) raised LlmkitError.*file not found"):
        check_component(
            get_registry().get("dataset", "text"), {"paths": [str(tmp_path / "missing.txt")]}
        )


# -- hand-made sources --------------------------------------------------------------------------


class Opts(ComponentOptions):
    n: int = 6


class Good:
    """Documents made from the options: every third one held out."""

    Options = Opts

    def __init__(self, options: Opts) -> None:
        self.options = options

    def docs(self, seed: int) -> list[str]:
        return [f"doc {seed} {i}" for i in range(self.options.n)]

    def columns(self, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
        docs = self.docs(seed)
        val = [d for i, d in enumerate(docs) if i % 3 == 0]
        return {"text": [d for d in docs if d not in val]}, {"text": val}

    def splits(self, seed: int):
        import datasets

        train, val = self.columns(seed)
        return datasets.DatasetDict(
            {
                "train": datasets.Dataset.from_dict(train),
                "validation": datasets.Dataset.from_dict(val),
            }
        )

    def describe(self) -> str:
        return f"good: {self.options.n} documents"

    def fingerprint(self) -> str:
        return f"n={self.options.n}"


class NoValidation(Good):
    def splits(self, seed):
        import datasets

        return datasets.DatasetDict({"train": super().splits(seed)["train"]})


class NotText(Good):
    def columns(self, seed):
        return {"text": [1, 2, 3]}, {"text": [4]}


class NoTextColumn(Good):
    def columns(self, seed):
        train, val = super().columns(seed)
        return {"body": train["text"]}, val


class EmptyTrain(Good):
    def splits(self, seed):
        import datasets

        text = datasets.Features({"text": datasets.Value("string")})
        return datasets.DatasetDict(
            {
                "train": datasets.Dataset.from_dict({"text": []}, features=text),
                "validation": datasets.Dataset.from_dict({"text": ["held out"]}, features=text),
            }
        )


class SameSplit(Good):
    def splits(self, seed):
        import datasets

        ds = super().splits(seed)["train"]
        return datasets.DatasetDict({"train": ds, "validation": ds})


class CopiedValidation(Good):
    def columns(self, seed):
        train, _ = super().columns(seed)
        return train, {"text": list(train["text"][:2])}


class Drifting(Good):
    calls = 0

    def docs(self, seed):
        type(self).calls += 1
        return [f"doc {type(self).calls} {i}" for i in range(self.options.n)]


class NotADict(Good):
    def splits(self, seed):
        return [super().splits(seed)["train"]]


class MultiLineDescribe(Good):
    def describe(self):
        return "good:\n6 documents"


class EmptyDescribe(Good):
    def describe(self):
        return ""


class UnstableFingerprint(Good):
    count = 0

    def fingerprint(self):
        self.count += 1
        return f"n={self.options.n} call={self.count}"


class IntFingerprint(Good):
    def fingerprint(self):
        return 42


class Crashing(Good):
    def splits(self, seed):
        raise RuntimeError("boom")


class ConfigError(Good):
    def splits(self, seed):
        raise LlmkitError("data.source.paths: name at least one file")


def test_a_good_source_passes():
    check_component(fake("dataset", Good))
    check_component(fake("dataset", Good), {"n": 2})


@pytest.mark.parametrize(
    ("target", "match"),
    [
        (NoValidation, "no 'validation' split"),
        (NotText, "'text' column holds .*not strings"),
        (NoTextColumn, "train split has no 'text' column"),
        (EmptyTrain, "train split has no documents"),
        (SameSplit, "train and validation splits are the same dataset"),
        (CopiedValidation, "validation split is a copy of train's rows"),
        (Drifting, "not deterministic"),
        (NotADict, "not a datasets.DatasetDict"),
        (MultiLineDescribe, "describe.*not one line"),
        (EmptyDescribe, "describe.*empty string"),
        (UnstableFingerprint, "fingerprint.*not stable"),
        (IntFingerprint, "fingerprint.*not a str"),
        (Crashing, r"splits\(0\) raised RuntimeError: boom"),
    ],
    ids=lambda x: x.__name__ if isinstance(x, type) else None,
)
def test_broken_source_fails(target, match):
    with pytest.raises(AssertionError, match=match) as info:
        check_component(fake("dataset", target))
    assert "dataset 'fake'" in str(info.value)


def test_a_config_error_with_default_options_is_not_a_failure():
    check_component(fake("dataset", ConfigError))  # like a file source without paths
    with pytest.raises(AssertionError, match=r"splits\(0\) raised LlmkitError"):
        check_component(fake("dataset", ConfigError), {"n": 3})


def test_required_options_without_options_check_only_the_generic_part():
    class Needs(Opts):
        path: str

    class NeedsPath(Crashing):
        Options = Needs

    check_component(fake("dataset", NeedsPath))
    with pytest.raises(AssertionError, match="boom"):
        check_component(fake("dataset", NeedsPath), {"path": "x"})
