"""Hostile spec files are refused in one line that names the file itself (its path, not its
folder): alias bombs, deep nesting, bytes that are not UTF-8, values Python will not build,
keys that are not strings, a folder or a pipe given as the file, an ``extends`` chain
without end; and ``--set`` keys and values nested without end."""

from __future__ import annotations

import os

import pytest

from llmkit import cli
from llmkit.errors import LlmkitError
from llmkit.spec import apply_override, files, load_raw, load_spec, read_spec_file

BOMB = "\n".join(
    ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    + [f"{n}: &{n} [{', '.join([f'*{p}'] * 10)}]" for p, n in zip("abcdefgh", "bcdefghi")]
)
MAPPING_BOMB = "\n".join(
    ["a0: &a0 {k0: 1, k1: 1, k2: 1, k3: 1, k4: 1, k5: 1, k6: 1, k7: 1, k8: 1, k9: 1}"]
    + [
        f"a{i}: &a{i} {{" + ", ".join(f"m{j}: *a{i - 1}" for j in range(10)) + "}"
        for i in range(1, 8)
    ]
)
MERGE_BOMB = "\n".join(
    ["a0: &a0 {k0: 1, k1: 1, k2: 1, k3: 1, k4: 1, k5: 1, k6: 1, k7: 1, k8: 1, k9: 1}"]
    + [f"a{i}: &a{i} {{<<: *a{i - 1}, x{i}: *a{i - 1}}}" for i in range(1, 30)]
)

CASES = [
    ("bomb.yaml", BOMB.encode(), "invalid YAML: aliases expand to more than 100,000 values"),
    ("map-bomb.yaml", MAPPING_BOMB.encode(), "invalid YAML: aliases expand to more than"),
    ("merge-bomb.yaml", MERGE_BOMB.encode(), "invalid YAML: aliases expand to more than"),
    ("rec.yaml", b"a: &a [1, *a]\n", "invalid YAML: recursive alias"),
    ("flow.yaml", b"a: " + b"[" * 5000 + b"]" * 5000, "invalid YAML: nested more than 32"),
    (
        "block.yaml",
        "".join("  " * i + f"k{i}:\n" for i in range(40)).encode(),
        "nested more than 32 levels",
    ),
    ("flow.toml", b"a = " + b"[" * 5000 + b"]" * 5000, "invalid TOML: nested more than 32"),
    (
        "tables.toml",
        ("[" + ".".join(f"k{i}" for i in range(40)) + "]\nv = 1\n").encode(),
        "nested more than 32 levels deep",
    ),
    ("latin1.yaml", "name: caf\xe9\n".encode("latin-1"), "not UTF-8 text (byte 9: invalid"),
    ("latin1.toml", 'name = "caf\xe9"\n'.encode("latin-1"), "not UTF-8 text (byte 11: invalid"),
    ("utf16.yaml", "name: x\n".encode("utf-16"), "not UTF-8 text (byte 0: invalid start byte)"),
    ("date.yaml", b"name: x\nwhen: 2024-13-45\n", "invalid YAML: month must be in 1..12"),
    ("day.yaml", b"when: !!timestamp 2023-02-30\n", "invalid YAML: day is out of range"),
    ("int.yaml", b"a: " + b"9" * 5000 + b"\n", "invalid YAML: an integer of more than 4300"),
    ("int.toml", b"a = " + b"9" * 5000 + b"\n", "invalid TOML: an integer of more than 4300"),
    ("key.yaml", b"name: x\n1: y\n", "invalid YAML: key '1' at line 2 reads as int 1, not a"),
    ("on.yaml", b"name: x\non: 1\n", "invalid YAML: key 'on' at line 2 reads as bool True"),
    ("null.yaml", b"~: 1\n", "invalid YAML: key '~' at line 1 reads as NoneType None"),
    ("dup.yaml", b"a: 1\na: 2\n", "invalid YAML: duplicate key 'a' at line 2"),
    ("list.yaml", b"- a\n", "a spec must be a table/mapping at the top level"),
    ("nul.yaml", b"name: \x00\n", "invalid YAML: unacceptable character #x0000"),
    ("spec.json", b"{}", "unknown spec format '.json'"),
]


@pytest.mark.parametrize(("name", "content", "expected"), CASES, ids=[c[0] for c in CASES])
def test_every_refusal_is_one_line_naming_the_file(tmp_path, name, content, expected):
    path = tmp_path / "specs" / name
    path.parent.mkdir()
    path.write_bytes(content)
    with pytest.raises(LlmkitError) as err:
        read_spec_file(path)
    message = str(err.value)
    assert message.startswith(f"{path}: {expected}"), message
    assert "\n" not in message and len(message) < 400


def test_a_directory_is_named_as_one(tmp_path):
    folder = tmp_path / "spec.yaml"
    folder.mkdir()
    for given in (folder, tmp_path):
        with pytest.raises(LlmkitError) as err:
            read_spec_file(given)
        assert str(err.value) == f"{given}: is a directory, not a spec file"
    with pytest.raises(LlmkitError, match=r"^spec file not found: "):
        read_spec_file(tmp_path / "missing.yaml")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_pipe_is_not_read(tmp_path):
    fifo = tmp_path / "spec.yaml"
    os.mkfifo(fifo)
    with pytest.raises(LlmkitError) as err:  # opening it would wait for a writer forever
        read_spec_file(fifo)
    assert str(err.value) == f"{fifo}: not a regular file"


def test_a_file_larger_than_the_limit_is_refused_unparsed(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "MAX_SPEC_BYTES", 1000)
    path = tmp_path / "big.yaml"
    path.write_text("a: " + "x" * 1000 + "\n")
    with pytest.raises(LlmkitError) as err:
        read_spec_file(path)
    assert str(err.value).startswith(f"{path}: larger than ")
    path.write_text("a: " + "x" * 900 + "\n")
    assert len(read_spec_file(path)["a"]) == 900


def test_an_extends_chain_without_end_is_refused_naming_the_file(tmp_path):
    n = files.MAX_EXTENDS + 5
    for i in range(n):
        (tmp_path / f"s{i}.yaml").write_text(f"extends: s{i + 1}.yaml\n")
    (tmp_path / f"s{n}.yaml").write_text("name: end\n")
    with pytest.raises(LlmkitError) as err:
        load_raw(tmp_path / "s0.yaml")
    last = tmp_path.resolve() / f"s{files.MAX_EXTENDS - 1}.yaml"
    assert str(err.value).startswith(f"{last}: extends: a chain of more than 32 files (from ")
    (tmp_path / "s20.yaml").write_text("name: end\n")  # 21 files: fine
    assert load_raw(tmp_path / "s0.yaml") == {"name": "end"}


def test_extends_errors_name_the_file_that_extends_or_the_bad_base(tmp_path):
    (tmp_path / "base.yaml").mkdir()
    child = tmp_path / "child.yaml"
    child.write_text("extends: base.yaml\n")
    with pytest.raises(LlmkitError) as err:
        load_raw(child)
    assert str(err.value) == (
        f"{child}: extends: {tmp_path / 'base.yaml'} is a directory, not a spec file"
    )
    (tmp_path / "bomb.yaml").write_text(BOMB)
    child.write_text("extends: bomb.yaml\n")
    with pytest.raises(LlmkitError) as err:
        load_raw(child)
    assert str(err.value).startswith(f"{tmp_path.resolve() / 'bomb.yaml'}: invalid YAML: aliases")


@pytest.mark.parametrize(
    ("assignment", "expected"),
    [
        (".".join(["a"] * 5000) + "=1", "--set a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.…: nested"),
        ("model.x=" + "{a=" * 40 + "1" + "}" * 40, "--set model.x: nested more than 32 levels"),
        ("model.x=" + "[" * 5000 + "]" * 5000, "--set value nested too deeply"),
        ("model.x=" + "9" * 5000, "--set value 9999999999999999999999999999999999999999...: an"),
    ],
)
def test_set_overrides_nested_without_end_are_one_line(assignment, expected):
    with pytest.raises(LlmkitError) as err:
        apply_override({"model": {}}, assignment)
    assert str(err.value).startswith(expected) and "\n" not in str(err.value)
    apply_override({"model": {}}, "model." + ".".join(["a"] * 30) + "=1")  # 32 deep: fine


def test_the_cli_names_the_file(tmp_path, capsys):
    bomb = tmp_path / "specs" / "bomb.yaml"
    bomb.parent.mkdir()
    bomb.write_text(BOMB)
    assert cli.main(["validate", str(bomb)]) != 0
    out = capsys.readouterr()
    assert f"{bomb}: invalid YAML: aliases expand" in out.out + out.err
    assert cli.main(["train", str(bomb.parent)]) == 2
    assert capsys.readouterr().err == f"error: {bomb.parent}: is a directory, not a spec file\n"


def test_load_spec_names_the_file_for_yaml_values_python_refuses(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text("model: {d_model: 32}\ntrain: {max_steps: 2024-02-30}\n")
    with pytest.raises(LlmkitError, match=rf"^{path}: invalid YAML: day is out of range"):
        load_spec(path)


def test_specs_that_read_before_still_read(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text(
        "name: ok\n'on': 1\n'1': 2\nwhen: 2024-02-29\nbase: &b {x: 1}\nm: {<<: *b, y: 2}\n"
    )
    data = read_spec_file(path)
    assert data["on"] == 1 and data["1"] == 2 and data["m"] == {"x": 1, "y": 2}
