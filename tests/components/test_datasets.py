"""Dataset sources: python-stdlib, text, jsonl, parquet, saved."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmkit.errors import LlmkitError
from llmkit.spec import load_spec_dict
from tests.helpers import tiny_spec


def source(name: str, **options: Any) -> Any:
    """The source named in a spec, resolved through the registry and built."""
    spec = tiny_spec()
    spec["data"] = {"source": {"name": name, **options}}
    rs = load_spec_dict(spec)
    return rs.dataset.build(rs.dataset.options)


def rows(ds: Any, column: str = "text") -> list[Any]:
    return list(ds[column])


# -- python-stdlib ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stdlib_full() -> tuple[Any, Any]:
    src = source("python-stdlib")
    return src, src.splits(1337)


def test_stdlib_nonempty_and_split_by_file(stdlib_full: tuple[Any, Any]) -> None:
    src, parts = stdlib_full
    train, val = set(rows(parts["train"], "path")), set(rows(parts["validation"], "path"))
    assert len(train) > 100 and len(val) > 5
    assert not train & val
    assert "os.py" in train | val
    assert all(isinstance(t, str) and t for t in rows(parts["validation"]))
    assert 0.01 < len(val) / (len(train) + len(val)) < 0.15
    assert "train files" in src.describe() and "validation files" in src.describe()


def test_stdlib_excludes_tests_and_site_packages(stdlib_full: tuple[Any, Any]) -> None:
    src, _ = stdlib_full
    rels = [rel for rel, _ in src.files()]
    assert rels == sorted(rels)
    for rel in rels:
        parts = set(rel.split("/")[:-1])
        assert not parts & {"test", "tests", "idle_test", "site-packages", "dist-packages"}, rel
    with_tests = [rel for rel, _ in source("python-stdlib", include_tests=True).files()]
    assert any(rel.startswith("test/") for rel in with_tests)
    assert len(with_tests) > len(rels)


def test_stdlib_deterministic_and_cap_independent(stdlib_full: tuple[Any, Any]) -> None:
    _, parts = stdlib_full
    full_split = {p: "train" for p in rows(parts["train"], "path")}
    full_split |= {p: "validation" for p in rows(parts["validation"], "path")}
    a = source("python-stdlib", max_files=60).splits(1337)
    b = source("python-stdlib", max_files=60).splits(1337)
    for name in ("train", "validation"):
        assert rows(a[name], "path") == rows(b[name], "path")
        assert rows(a[name]) == rows(b[name])
    assert len(a["train"]) + len(a["validation"]) == 60
    # a file's split depends on the seed and its path only, never on which files are used
    # (one file may be moved to validation if none landed there on its own)
    capped = {p: "train" for p in rows(a["train"], "path")}
    capped |= {p: "validation" for p in rows(a["validation"], "path")}
    differ = [p for p in capped if capped[p] != full_split[p]]
    natural_val = any(full_split[p] == "validation" for p in capped)
    assert differ == [] if natural_val else len(differ) == 1 and capped[differ[0]] == "validation"
    other = source("python-stdlib", max_files=60).splits(7)
    assert rows(other["train"], "path") != rows(a["train"], "path")


def test_stdlib_independent_of_listing_order(tmp_path: Path, monkeypatch) -> None:
    from llmkit.components.dataset import python_stdlib as mod

    for i in range(30):
        write(tmp_path / f"pkg{i % 3}" / f"m{i}.py", f"x = {i}\n")
    write(tmp_path / "test" / "test_x.py", "assert True\n")
    write(tmp_path / "site-packages" / "foo.py", "import foo\n")
    write(tmp_path / "bad.py", "")
    (tmp_path / "latin.py").write_bytes("s = 'café'\n".encode("latin-1"))
    opts = mod.Options(val_fraction=0.2)
    first = mod.PythonStdlib(opts, root=tmp_path).splits(1)
    real_walk = mod.os.walk

    def reversed_walk(top):
        for dirpath, dirnames, filenames in real_walk(top):
            dirnames.reverse()  # in place: the caller's pruning still applies
            yield dirpath, dirnames, filenames[::-1]

    monkeypatch.setattr(mod.os, "walk", reversed_walk)
    second = mod.PythonStdlib(opts, root=tmp_path).splits(1)
    for name in ("train", "validation"):
        assert rows(first[name], "path") == rows(second[name], "path")
    used = rows(first["train"], "path") + rows(first["validation"], "path")
    assert len(used) == 30  # no tests, no site-packages, no empty or non-UTF-8 file


def test_stdlib_max_bytes() -> None:
    src = source("python-stdlib", max_bytes=200_000)
    parts = src.splits(0)
    total = sum(len(t.encode()) for name in parts for t in rows(parts[name]))
    assert 0 < total <= 200_000
    assert len(parts["validation"]) >= 1


def test_stdlib_too_few_files() -> None:
    with pytest.raises(LlmkitError, match="at least 2"):
        source("python-stdlib", max_files=1).splits(0)


def test_stdlib_options_validated() -> None:
    with pytest.raises(LlmkitError, match="val_fraction"):
        source("python-stdlib", val_fraction=1.5)
    with pytest.raises(LlmkitError, match="unknown option"):
        source("python-stdlib", max_filez=3)


# -- text -------------------------------------------------------------------------------------


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_text_tail_split(tmp_path: Path) -> None:
    a = write(tmp_path / "a.txt", "".join(chr(97 + i % 26) for i in range(1000)))
    b = write(tmp_path / "b.txt", "naïve 東京 🚀\n" * 50)
    src = source("text", paths=[str(tmp_path / "*.txt")])
    parts = src.splits(0)
    train, val = rows(parts["train"]), rows(parts["validation"])
    assert rows(parts["train"], "path") == [str(a), str(b)]
    assert [len(t) for t in train] == [900, int(len(b.read_text()) * 0.9)]
    assert [t + v for t, v in zip(train, val)] == [a.read_text(), b.read_text()]
    assert "2 file(s)" in src.describe()
    parts = source("text", paths=[str(a)], val_fraction=0.25).splits(0)
    assert len(rows(parts["validation"])[0]) == 250


def test_text_file_split(tmp_path: Path) -> None:
    for i in range(12):
        write(tmp_path / f"d{i:02d}.txt", f"document {i}\n" * 10)
    opts = {"paths": [str(tmp_path / "d*.txt")], "split": "file", "val_fraction": 0.25}
    a, b = source("text", **opts).splits(3), source("text", **opts).splits(3)
    train, val = rows(a["train"], "path"), rows(a["validation"], "path")
    assert train == rows(b["train"], "path") and val == rows(b["validation"], "path")
    assert train and val and not set(train) & set(val)
    assert len(train) + len(val) == 12
    assert all(t.startswith("document") for t in rows(a["validation"]))


def test_text_file_split_needs_two_files(tmp_path: Path) -> None:
    write(tmp_path / "one.txt", "only one file\n")
    with pytest.raises(LlmkitError, match="at least 2 files"):
        source("text", paths=[str(tmp_path / "one.txt")], split="file").splits(0)


def test_text_val_paths(tmp_path: Path) -> None:
    write(tmp_path / "train1.txt", "first\n")
    write(tmp_path / "train2.txt", "second\n")
    val = write(tmp_path / "val.txt", "held out\n")
    src = source("text", paths=[str(tmp_path / "*.txt")], val_paths=[str(val)])
    parts = src.splits(0)
    assert rows(parts["train"]) == ["first\n", "second\n"]  # val.txt left out of train
    assert rows(parts["validation"]) == ["held out\n"]


def test_text_errors(tmp_path: Path) -> None:
    with pytest.raises(LlmkitError, match="file not found"):
        source("text", paths=[str(tmp_path / "missing.txt")]).splits(0)
    with pytest.raises(LlmkitError, match="matches no file"):
        source("text", paths=[str(tmp_path / "*.nothing")]).splits(0)
    with pytest.raises(LlmkitError, match="is a directory"):
        source("text", paths=[str(tmp_path)]).splits(0)
    with pytest.raises(LlmkitError, match="at least one file"):
        source("text").splits(0)
    write(tmp_path / "empty1.txt", "")
    write(tmp_path / "empty2.txt", "")
    with pytest.raises(LlmkitError, match="no text"):
        source("text", paths=[str(tmp_path / "empty*.txt")]).splits(0)
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(LlmkitError, match="not UTF-8"):
        source("text", paths=[str(tmp_path / "latin1.txt")]).splits(0)


def test_text_fingerprint_tracks_edits(tmp_path: Path) -> None:
    f = write(tmp_path / "a.txt", "one\n")
    src = source("text", paths=[str(f)])
    before = src.fingerprint()
    write(f, "one two\n")
    assert src.fingerprint() != before


# -- jsonl / parquet --------------------------------------------------------------------------


def records(n: int, field: str = "text") -> list[dict[str, Any]]:
    return [{"id": i, field: f"record number {i}\n"} for i in range(n)]


def write_jsonl(path: Path, recs: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def write_parquet(path: Path, recs: list[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(recs), path)
    return path


WRITERS = {"jsonl": (write_jsonl, "jsonl"), "parquet": (write_parquet, "parquet")}


@pytest.mark.parametrize("name", ["jsonl", "parquet"])
def test_table_source_split(name: str, tmp_path: Path) -> None:
    writer, ext = WRITERS[name]
    writer(tmp_path / f"a.{ext}", records(30, "body"))
    opts = {
        "paths": [str(tmp_path / f"*.{ext}")],
        "text_field": "body",
        "val_fraction": 0.1,
        "cache_dir": str(tmp_path / "hf"),
    }
    a, b = source(name, **opts).splits(5), source(name, **opts).splits(5)
    assert a["train"].column_names == ["text"]
    assert len(a["train"]) == 27 and len(a["validation"]) == 3
    assert rows(a["validation"]) == rows(b["validation"])
    everything = sorted(rows(a["train"]) + rows(a["validation"]))
    assert everything == sorted(r["body"] for r in records(30, "body"))


@pytest.mark.parametrize("name", ["jsonl", "parquet"])
def test_table_source_val_paths(name: str, tmp_path: Path) -> None:
    writer, ext = WRITERS[name]
    writer(tmp_path / f"train.{ext}", records(5))
    val = writer(tmp_path / f"val.{ext}", records(2))
    opts = {"paths": [str(tmp_path / f"*.{ext}")], "val_paths": [str(val)]}
    parts = source(name, cache_dir=str(tmp_path / "hf"), **opts).splits(0)
    assert len(parts["train"]) == 5 and len(parts["validation"]) == 2


@pytest.mark.parametrize("name", ["jsonl", "parquet"])
def test_table_source_missing_field(name: str, tmp_path: Path) -> None:
    writer, ext = WRITERS[name]
    writer(tmp_path / f"a.{ext}", records(4, "content"))
    src = source(name, paths=[str(tmp_path / f"a.{ext}")], cache_dir=str(tmp_path / "hf"))
    with pytest.raises(LlmkitError, match=r"no text field 'text' \(fields: id, content\)"):
        src.splits(0)
    src = source(
        name, paths=[str(tmp_path / f"a.{ext}")], text_field="id", cache_dir=str(tmp_path / "hf")
    )
    with pytest.raises(LlmkitError, match="not text"):
        src.splits(0)


def test_bad_files(tmp_path: Path) -> None:
    good = write_jsonl(tmp_path / "good.jsonl", records(3))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json at all\n')
    src = source("jsonl", paths=[str(good), str(bad)], cache_dir=str(tmp_path / "hf"))
    with pytest.raises(LlmkitError, match=r"bad\.jsonl: cannot read as json"):
        src.splits(0)
    (tmp_path / "bad.parquet").write_bytes(b"garbage")
    src = source("parquet", paths=[str(tmp_path / "bad.parquet")], cache_dir=str(tmp_path / "hf"))
    with pytest.raises(LlmkitError, match=r"bad\.parquet: cannot read as parquet"):
        src.splits(0)
    with pytest.raises(LlmkitError, match="matches no file"):
        source("jsonl", paths=[str(tmp_path / "*.json")]).splits(0)


def test_single_record_cannot_split(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "one.jsonl", records(1))
    with pytest.raises(LlmkitError, match="cannot be split"):
        source("jsonl", paths=[str(f)], cache_dir=str(tmp_path / "hf")).splits(0)


# -- saved ------------------------------------------------------------------------------------


def test_saved_dataset_and_dict(tmp_path: Path) -> None:
    import datasets

    ds = datasets.Dataset.from_list(records(20, "content"))
    ds.save_to_disk(str(tmp_path / "plain"))
    parts = source("saved", path=str(tmp_path / "plain"), text_field="content").splits(0)
    assert len(parts["train"]) == 19 and len(parts["validation"]) == 1
    assert not list((tmp_path / "plain").glob("cache-*"))  # nothing written into it

    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(records(6)),
            "test": datasets.Dataset.from_list(records(2)),
        }
    )
    dd.save_to_disk(str(tmp_path / "dict"))
    parts = source("saved", path=str(tmp_path / "dict")).splits(0)
    assert len(parts["train"]) == 6 and len(parts["validation"]) == 2
    assert parts["train"].column_names == ["text"]


def test_saved_errors(tmp_path: Path) -> None:
    import datasets

    with pytest.raises(LlmkitError, match="directory not found"):
        source("saved", path=str(tmp_path / "nope")).splits(0)
    with pytest.raises(LlmkitError, match="name the directory"):
        source("saved").splits(0)
    (tmp_path / "junk").mkdir()
    with pytest.raises(LlmkitError, match="save_to_disk"):
        source("saved", path=str(tmp_path / "junk")).splits(0)
    dd = datasets.DatasetDict(
        {"a": datasets.Dataset.from_list(records(3)), "b": datasets.Dataset.from_list(records(3))}
    )
    dd.save_to_disk(str(tmp_path / "noTrain"))
    with pytest.raises(LlmkitError, match=r"no 'train' split \(splits: a, b\)"):
        source("saved", path=str(tmp_path / "noTrain")).splits(0)
    datasets.Dataset.from_list(records(3)).save_to_disk(str(tmp_path / "plain"))
    with pytest.raises(LlmkitError, match=r"no text field 'body' \(fields: id, text\)"):
        source("saved", path=str(tmp_path / "plain"), text_field="body").splits(0)
