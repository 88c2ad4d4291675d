"""The shared store of prepared data (llmkit.data.store): what one run prepares, the next run
over the same files, options, seed and tokenizer spec takes without loading the corpus."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llmkit.components.dataset.text import TextFiles
from llmkit.data import prepare_data
from llmkit.data import store as store_mod
from llmkit.data.store import DataStore, store_root
from tests.data.test_data import TEXT, make_rs


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the text source's corpus loads (``splits`` calls)."""
    calls: list[int] = []
    original = TextFiles.splits

    def counted(self: TextFiles, seed: int) -> Any:
        calls.append(seed)
        return original(self, seed)

    monkeypatch.setattr(TextFiles, "splits", counted)
    return calls


def _prepare(rs: Any, run_dir: Path) -> tuple[Any, list[str]]:
    lines: list[str] = []
    return prepare_data(rs, run_dir, log=lines.append), lines


def test_store_root_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("LLMKIT_CACHE_DIR", str(tmp_path / "c"))
    assert store_root() == tmp_path / "c"
    monkeypatch.delenv("LLMKIT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert store_root() == tmp_path / "xdg" / "llmkit"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert store_root() == Path.home() / ".cache" / "llmkit"


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_a_second_run_takes_the_tokenizer_and_tokens_without_loading_the_corpus(
    corpus: Path, tmp_path: Path, loads: list[int], kind: str
):
    rs = make_rs([corpus], {"kind": kind, "vocab_size": 300} if kind == "bpe" else None)
    first, _ = _prepare(rs, tmp_path / "run1")
    assert len(loads) == 1
    second, lines = _prepare(rs, tmp_path / "run2")
    assert len(loads) == 1, "the second run loaded the corpus"
    text = "\n".join(lines)
    assert "trained by an earlier run" in text and "shared cache" in text
    assert any(line.startswith("data: text: 1 file(s)") for line in lines)  # as first made
    assert second.source_description == first.source_description
    run1, run2 = tmp_path / "run1", tmp_path / "run2"
    assert (run2 / "tokenizer.json").read_bytes() == (run1 / "tokenizer.json").read_bytes()
    for a, b in ((first.train, second.train), (first.validation, second.validation)):
        assert a.path.parent == run1 / "data" and b.path.parent == run2 / "data"
        np.testing.assert_array_equal(a.array, b.array)
        assert b.n_bytes_text == a.n_bytes_text
        assert os.path.samefile(a.path, b.path)  # hard links: one copy on disk
    assert second.key == first.key
    # The run directory is whole without the store.
    shutil.rmtree(store_root())
    third, _ = _prepare(rs, run2)
    assert len(loads) == 1  # the run's own files
    np.testing.assert_array_equal(third.train.array, first.train.array)


def test_an_edited_corpus_is_prepared_again(corpus: Path, tmp_path: Path, loads: list[int]):
    rs = make_rs([corpus])
    first, _ = _prepare(rs, tmp_path / "run1")
    corpus.write_text("zebra quartz\n" + TEXT, encoding="utf-8")
    second, lines = _prepare(rs, tmp_path / "run2")
    assert len(loads) == 2
    assert not any("earlier run" in line for line in lines)
    assert second.tokenizer.token_to_id("z") is not None
    assert first.tokenizer.token_to_id("z") is None
    assert second.key != first.key


def _copy_elsewhere(tmp_path: Path, name: str) -> Path:
    """A copy of the corpus in another directory, with another modification time (what a
    checkout copied to another machine has)."""
    there = tmp_path / name
    there.mkdir()
    copy = there / "corpus.txt"
    copy.write_text(TEXT, encoding="utf-8")
    os.utime(copy, ns=(1_000_000_000, 1_000_000_000))
    return there


def test_a_copy_of_the_corpus_elsewhere_takes_the_stored_files(
    tmp_path: Path, loads: list[int], monkeypatch: pytest.MonkeyPatch
):
    """Keyed by content (and the path as the spec names it), a store made from one copy
    serves another copy at another place: the run there loads no corpus (needs no
    ``datasets``)."""
    rs = make_rs([Path("corpus.txt")])  # relative, as a spec inside a checkout names it
    monkeypatch.chdir(_copy_elsewhere(tmp_path, "here"))
    first, _ = _prepare(rs, tmp_path / "run1")
    monkeypatch.chdir(_copy_elsewhere(tmp_path, "there"))
    os.utime("corpus.txt", ns=(2_000_000_000, 2_000_000_000))
    second, lines = _prepare(rs, tmp_path / "run2")
    assert len(loads) == 1, "the copy was prepared again"
    assert second.key == first.key
    assert sum("shared cache" in line for line in lines) == 2
    np.testing.assert_array_equal(second.train.array, first.train.array)


def test_a_same_size_edit_that_kept_the_time_is_prepared_again(
    corpus: Path, tmp_path: Path, loads: list[int]
):
    rs = make_rs([corpus])
    first, _ = _prepare(rs, tmp_path / "run1")
    st = corpus.stat()
    corpus.write_text(TEXT[::-1], encoding="utf-8")  # the same bytes, in another order
    assert corpus.stat().st_size == st.st_size
    os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns))
    second, _ = _prepare(rs, tmp_path / "run2")
    assert len(loads) == 2
    assert second.key != first.key


def test_large_inputs_are_keyed_by_path_size_and_time(
    tmp_path: Path, loads: list[int], monkeypatch: pytest.MonkeyPatch
):
    """Past the content limit the key is the resolved path, size and modification time: a
    copy at another place is prepared again, an untouched file is not."""
    from llmkit.components import dataset

    monkeypatch.setattr(dataset, "CONTENT_FINGERPRINT_LIMIT", 10)
    rs = make_rs([Path("corpus.txt")])
    monkeypatch.chdir(_copy_elsewhere(tmp_path, "here"))
    _prepare(rs, tmp_path / "run1")
    _prepare(rs, tmp_path / "run2")
    assert len(loads) == 1
    monkeypatch.chdir(_copy_elsewhere(tmp_path, "there"))
    _prepare(rs, tmp_path / "run3")
    assert len(loads) == 2


@pytest.mark.parametrize(
    "change",
    [{"seed": 7}, {"source": {"val_fraction": 0.2}}, {"tokenizer": {"kind": "bpe"}}],
    ids=["seed", "source", "tokenizer"],
)
def test_a_different_recipe_is_prepared_again(
    corpus: Path, tmp_path: Path, loads: list[int], change: dict[str, Any]
):
    _prepare(make_rs([corpus]), tmp_path / "run1")
    tok = change.pop("tokenizer", None)
    _, lines = _prepare(make_rs([corpus], tok, **change), tmp_path / "run2")
    assert len(loads) == 2
    assert not any("earlier run" in line for line in lines)


def test_shared_cache_false_keeps_nothing(corpus: Path, tmp_path: Path, loads: list[int]):
    rs = make_rs([corpus], shared_cache=False)
    _prepare(rs, tmp_path / "run1")
    _prepare(rs, tmp_path / "run2")
    assert len(loads) == 2
    assert not any(store_root().iterdir())


def test_a_resumed_run_does_not_load_the_corpus(corpus: Path, tmp_path: Path, loads: list[int]):
    rs = make_rs([corpus], shared_cache=False)
    first, _ = _prepare(rs, tmp_path / "run")
    again, lines = _prepare(rs, tmp_path / "run")  # a resume: tokenizer and files are there
    assert len(loads) == 1
    assert any("(cached train-" in line for line in lines)
    np.testing.assert_array_equal(again.train.array, first.train.array)


def test_a_damaged_store_entry_is_not_taken(corpus: Path, tmp_path: Path, loads: list[int]):
    rs = make_rs([corpus])
    first, _ = _prepare(rs, tmp_path / "run1")
    stored = store_root() / "tokens" / first.train.path.name
    os.unlink(stored)  # break the link before changing the file
    stored.write_bytes(first.train.path.read_bytes()[:-2])  # one token short
    second, lines = _prepare(rs, tmp_path / "run2")
    assert len(loads) == 2  # the train split had to be made again
    np.testing.assert_array_equal(second.train.array, first.train.array)
    assert any("validation" in line and "shared cache" in line for line in lines)


def test_a_store_that_cannot_be_written_only_loses_the_reuse(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    monkeypatch.setenv("LLMKIT_CACHE_DIR", str(blocked))
    prepared, lines = _prepare(make_rs([corpus]), tmp_path / "run")
    assert len(prepared.train) > 0
    assert any(line.startswith("data: not kept in the shared cache") for line in lines)


def test_copies_into_the_store_stop_at_the_limit(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    def no_links(src: Any, dst: Any) -> None:
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(store_mod.os, "link", no_links)
    first, _ = _prepare(make_rs([corpus]), tmp_path / "run1")
    stored = store_root() / "tokens" / first.train.path.name
    assert stored.is_file() and not os.path.samefile(stored, first.train.path)  # a copy
    monkeypatch.setattr(store_mod, "COPY_LIMIT", 10)
    second, lines = _prepare(make_rs([corpus], seed=3), tmp_path / "run2")
    assert not (store_root() / "tokens" / second.train.path.name).exists()
    assert any("copies over 10 bytes are not kept" in line for line in lines)
    assert not list((store_root() / "tokens").glob(".*.tmp"))


def test_fetched_files_are_whole_or_absent(corpus: Path, tmp_path: Path):
    first, _ = _prepare(make_rs([corpus]), tmp_path / "run1")
    store = DataStore()
    dst = tmp_path / "elsewhere"
    assert store.fetch_tokens(first.train.path.name, dst)
    assert sorted(p.name for p in dst.iterdir()) == sorted(
        [first.train.path.name, first.train.path.with_suffix(".json").name]
    )
    assert not store.fetch_tokens("train-000000000000.bin", dst)
