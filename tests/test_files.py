"""Atomic writes: a reader sees the old file or the new one, a failure leaves the old one and
no temporary file, several files are renamed in order, a full disk is one error naming the
file."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from llmkit.files import (
    NoSpaceLeft,
    replacing,
    replacing_all,
    temporary_name,
    write_json_atomic,
    write_text_atomic,
    writing,
)


def test_replacing_writes_the_target_under_a_temporary_name(tmp_path):
    target = tmp_path / "a.txt"
    target.write_text("old")
    with replacing(target) as tmp:
        assert tmp.parent == tmp_path and tmp != target and str(os.getpid()) in tmp.name
        tmp.write_text("new")
        assert target.read_text() == "old"  # nothing visible until the body returns
    assert target.read_text() == "new" and sorted(tmp_path.iterdir()) == [target]


def test_a_failed_body_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "a.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="midway"), replacing(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("midway")
    assert target.read_text() == "old" and sorted(tmp_path.iterdir()) == [target]


def test_a_suffix_keeps_the_format_a_writer_reads_from_the_name(tmp_path):
    target = tmp_path / "loss.png"
    assert temporary_name(target, ".png").suffix == ".png"
    with replacing(target, ".png") as tmp:
        assert tmp.name.endswith(".png")
        tmp.write_bytes(b"png")
    assert target.read_bytes() == b"png"


def test_replacing_all_renames_in_order_the_last_one_last(tmp_path, monkeypatch):
    paths = [tmp_path / "tokens.bin", tmp_path / "tokens.mask", tmp_path / "tokens.json"]
    renamed: list[str] = []
    real = os.replace

    def recording(src, dst):
        renamed.append(Path(dst).name)
        real(src, dst)

    monkeypatch.setattr("llmkit.files.os.replace", recording)
    with replacing_all(paths) as tmps:
        for tmp, path in zip(tmps, paths, strict=True):
            tmp.write_text(path.name)
    assert renamed == ["tokens.bin", "tokens.mask", "tokens.json"]
    assert [p.read_text() for p in paths] == [p.name for p in paths]
    assert sorted(tmp_path.iterdir()) == sorted(paths)


def test_replacing_all_leaves_no_file_when_the_body_fails(tmp_path):
    paths = [tmp_path / "a", tmp_path / "b"]
    with pytest.raises(ValueError), replacing_all(paths) as tmps:
        tmps[0].write_text("a")
        raise ValueError
    assert list(tmp_path.iterdir()) == []


def test_write_json_atomic(tmp_path):
    write_json_atomic(tmp_path / "x.json", {"step": 3})
    assert (tmp_path / "x.json").read_text() == '{\n  "step": 3\n}\n'


def test_a_full_disk_is_one_error_naming_the_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    target = tmp_path / "latest.json"
    target.write_text("old")

    def full(self, *_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(NoSpaceLeft, match=f"no space left on device writing {target}"):
        write_text_atomic(target, "new")
    monkeypatch.undo()
    assert target.read_text() == "old" and sorted(tmp_path.iterdir()) == [target]


def test_writing_passes_other_errors_through(tmp_path):
    with pytest.raises(PermissionError), writing(tmp_path / "x"):
        raise PermissionError("read-only")


def test_json_that_nests_too_deeply_or_is_not_json_is_a_one_line_error(tmp_path):
    from llmkit.errors import LlmkitError
    from llmkit.files import read_json

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000, encoding="utf-8")
    with pytest.raises(LlmkitError, match=r"deep\.json: invalid JSON: nested too deeply$"):
        read_json(deep)
    broken = tmp_path / "broken.json"
    broken.write_bytes(b'{"a": \xff}')
    with pytest.raises(LlmkitError, match=r"broken\.json: not UTF-8 text"):
        read_json(broken)
    broken.write_text('{"a": }', encoding="utf-8")
    with pytest.raises(LlmkitError, match=r"broken\.json: invalid JSON: Expecting value"):
        read_json(broken)
    (tmp_path / "ok.json").write_text('{"a": [1]}', encoding="utf-8")
    assert read_json(tmp_path / "ok.json") == {"a": [1]}
