"""A hostile or unlucky run directory: planted pickles, full disks, damaged checkpoints,
divergence and two processes on one run."""

from __future__ import annotations

import errno
import json
import math
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmkit.errors import LlmkitError
from llmkit.files import NoSpaceLeft
from llmkit.runs.checkpoints import CHECKSUMS, META, Checkpoints, sha256
from llmkit.runs.lock import LOCK_FILE, RunInUse, RunLock
from llmkit.runs.resume import restartable
from llmkit.training import train
from tests.conftest import ROOT
from tests.training.test_train import write_spec


def _quiet(**kw):
    return {"log": lambda _m: None, "progress": False, **kw}


def _resume(run: Path, *overrides: str, log=lambda _m: None):
    return train(run_dir=run, resume=True, overrides=list(overrides), log=log, progress=False)


@pytest.fixture
def trained(tmp_path: Path) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    run = tmp_path / "run"
    train(write_spec(tmp_path, max_steps=4, eval_interval=2), run_dir=run, **_quiet())
    return run


def _ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:06d}"


def _rewrite_state(ckpt: Path, state: object) -> None:
    """Replace state.pt and its checksum in meta.json, as a careful tamperer would."""
    torch.save(state, ckpt / "state.pt")
    meta = json.loads((ckpt / META).read_text())
    meta[CHECKSUMS]["state.pt"] = sha256(ckpt / "state.pt")
    (ckpt / META).write_text(json.dumps(meta))


class _Planted:
    """Unpickling this creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


# -- 1. no code from a run directory ---------------------------------------------------------


def test_a_planted_shard_pickle_is_never_unpickled_on_one_process(trained, tmp_path):
    marker = tmp_path / "pwned"
    shards = _ckpt(trained, 4) / "dcp"
    shards.mkdir()
    (shards / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    (shards / "__0_0.distcp").write_bytes(pickle.dumps(_Planted(marker)))
    result = _resume(trained, "train.max_steps=6")
    assert result.step == 6
    assert not marker.exists()


def test_a_shards_only_optimizer_is_refused_on_one_process(trained, tmp_path):
    marker = tmp_path / "pwned"
    ckpt = _ckpt(trained, 4)
    (ckpt / "dcp").mkdir()
    (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    state = torch.load(ckpt / "state.pt", weights_only=True)
    del state["optimizer"]  # what an fsdp checkpoint written before llmkit 0.x held
    _rewrite_state(ckpt, state)
    with pytest.raises(LlmkitError, match=r"only in the fsdp shards \(dcp/\)") as info:
        _resume(trained, "train.max_steps=6")
    assert "\n" not in str(info.value) and not marker.exists()


def test_shards_are_read_only_when_trusted_and_never_run_code(tmp_path, monkeypatch):
    from llmkit.training import distributed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    path = tmp_path / "dcp"
    distributed.save_sharded(model, opt, str(path))
    other = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
    monkeypatch.delenv(distributed.TRUST_ENV, raising=False)
    with pytest.raises(LlmkitError, match="LLMKIT_TRUST_CHECKPOINTS=1"):
        distributed.load_sharded(other, other_opt, str(path))
    monkeypatch.setenv(distributed.TRUST_ENV, "1")
    distributed.load_sharded(other, other_opt, str(path))  # the real metadata passes
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(Exception, match="not allowed in checkpoint metadata"):
        distributed.load_sharded(other, other_opt, str(path))
    assert not marker.exists()


# -- 3. a full disk ----------------------------------------------------------------------------


def _enospc(*_a, **_k):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize(("target", "name"), [("torch.save", "state.pt"), ("save_model", "model")])
def test_a_full_disk_during_a_checkpoint_is_one_line(trained, monkeypatch, target, name):
    before = (trained / "checkpoints" / "latest.json").read_text()
    monkeypatch.setattr(f"llmkit.runs.checkpoints.{target}", _enospc)
    with pytest.raises(NoSpaceLeft) as info:
        _resume(trained, "train.max_steps=6")
    msg = str(info.value)
    assert "\n" not in msg and "no space left" in msg and name in msg, msg
    assert "step-000004 is still the latest" in msg
    assert not list((trained / "checkpoints").glob(".tmp-*"))
    assert (trained / "checkpoints" / "latest.json").read_text() == before


def test_a_full_disk_during_the_final_weights_is_one_line(tmp_path, monkeypatch):
    import llmkit.training.trainer as trainer_mod

    def full(_model, path):
        raise NoSpaceLeft(f"no space left on device writing {path}")

    monkeypatch.setattr(trainer_mod, "save_weights", full)
    run = tmp_path / "run"
    with pytest.raises(NoSpaceLeft, match=r"model\.safetensors"):
        train(write_spec(tmp_path, max_steps=2, eval_interval=2), run_dir=run, **_quiet())
    monkeypatch.undo()
    from llmkit.runs.checkpoints import save_weights

    monkeypatch.setattr("llmkit.runs.checkpoints.save_model", _enospc)
    with pytest.raises(NoSpaceLeft, match=r"writing .*model\.safetensors .*nothing was written"):
        save_weights(torch.nn.Linear(2, 2), run / "model.safetensors")
    assert not (run / ".model.safetensors.tmp").exists()


def test_torch_save_reports_a_full_disk_by_name(tmp_path, monkeypatch):
    """torch.save turns a failed write into a RuntimeError without errno: the file object
    llmkit hands it keeps the OSError. (Checked by hand on a 200 KB tmpfs too.)"""
    import llmkit.runs.checkpoints as ckpt_mod

    class Full:
        def __init__(self, *_a, **_k) -> None:
            self.written = 0

        def write(self, data) -> int:
            self.written += len(memoryview(data).cast("B"))
            if self.written > 1000:
                raise OSError(errno.ENOSPC, "No space left on device")
            return len(memoryview(data).cast("B"))

        def flush(self) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *_exc) -> None:
            pass

    monkeypatch.setattr(ckpt_mod, "open", Full, raising=False)
    target = tmp_path / "state.pt"
    with pytest.raises(NoSpaceLeft, match=f"no space left on device writing {target}"):
        ckpt_mod.save_tensors({"x": torch.zeros(100_000)}, target)


# -- 4. damaged checkpoints --------------------------------------------------------------------


def test_overwritten_tensor_bytes_are_noticed(trained):
    weights = _ckpt(trained, 4) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-64:] = bytes(64)  # same size, same header: only the checksum can tell
    weights.write_bytes(bytes(data))
    logs: list[str] = []
    result = _resume(trained, "train.max_steps=6", log=logs.append)
    assert result.step == 6
    assert any(
        "model.safetensors: contents differ from the SHA-256 in meta.json" in m
        and "resuming from step-000002" in m
        for m in logs
    ), logs


def _state(run: Path) -> dict:
    return torch.load(_ckpt(run, 4) / "state.pt", weights_only=True)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda s: {k: v for k, v in s.items() if k != "rng"}, "rng is missing"),
        (lambda s: {**s, "step": "sixty"}, "step is 'sixty', not a count"),
        (lambda s: [s["step"], s["tokens"]], "is a list, not a table"),
        (lambda s: {**s, "step": -5}, "step is -5, not a count"),
        (lambda s: {**s, "best_val": float("nan")}, "best_val is nan"),
    ],
)
def test_a_state_with_wrong_fields_falls_back_with_a_warning(trained, damage, message):
    _rewrite_state(_ckpt(trained, 4), damage(_state(trained)))
    logs: list[str] = []
    result = _resume(trained, "train.max_steps=6", log=logs.append)
    assert result.step == 6
    warning = [m for m in logs if m.startswith("warning:")]
    assert len(warning) == 1 and message in warning[0] and "state.pt" in warning[0], logs
    assert "resuming from step-000002" in warning[0]


@pytest.mark.parametrize("pointer", [None, "{garbage"])
def test_a_missing_or_damaged_latest_pointer_is_noted(trained, pointer):
    latest = trained / "checkpoints" / "latest.json"
    if pointer is None:
        latest.unlink()
    else:
        latest.write_text(pointer)
    logs: list[str] = []
    assert _resume(trained, "train.max_steps=5", log=logs.append).step == 5
    notes = [m for m in logs if m.startswith("note:")]
    assert len(notes) == 1 and "latest.json" in notes[0], logs
    assert "using the newest checkpoint, step-000004" in notes[0]


# -- 5. divergence -----------------------------------------------------------------------------


def _poison_after(monkeypatch, step: int) -> None:
    """Make the update of ``step`` leave a NaN weight (its own loss stays finite)."""
    import llmkit.training as train_mod

    original = train_mod.Trainer._train_step

    def poisoned(self):
        result = original(self)
        if self.step + 1 == step:  # the step just taken (counted once it returns)
            with torch.no_grad():
                next(self.model.parameters()).view(-1)[0] = float("nan")
        return result

    monkeypatch.setattr(train_mod.Trainer, "_train_step", poisoned)


def _strict(path: Path) -> list[dict]:
    def refuse(name: str) -> None:
        raise ValueError(f"bare {name} in {path}")

    return [json.loads(x, parse_constant=refuse) for x in path.read_text().splitlines()]


def test_a_non_finite_evaluation_is_never_saved_nor_best(tmp_path, monkeypatch):
    run = tmp_path / "run"
    _poison_after(monkeypatch, 4)
    spec = write_spec(tmp_path, max_steps=4, eval_interval=2)
    with pytest.raises(LlmkitError) as info:
        train(spec, run_dir=run, **_quiet())
    msg = str(info.value)
    assert "non-finite validation loss" in msg and "step-000002" in msg and "\n" not in msg
    ckpts = Checkpoints(run)
    assert ckpts.latest().name == "step-000002" and ckpts.best().name == "step-000002"
    assert not (run / "model.safetensors").exists()
    records = _strict(run / "metrics.jsonl")
    assert records[-1] == {"step": 4, "val_loss": None}


def test_non_finite_weights_on_a_checkpoint_step_are_never_saved(tmp_path, monkeypatch):
    run = tmp_path / "run"
    _poison_after(monkeypatch, 3)
    spec = write_spec(tmp_path, max_steps=8, eval_interval=8, checkpoint_interval=1)
    with pytest.raises(LlmkitError, match=r"non-finite weights after step 3; .*step-000002"):
        train(spec, run_dir=run, **_quiet())
    assert Checkpoints(run).latest().name == "step-000002"
    _strict(run / "metrics.jsonl")


def test_metrics_stay_strict_json(tmp_path):
    from llmkit.runs.metrics import MetricsLog

    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write({"step": 1, "loss": float("nan"), "grad_norm": math.inf})
    assert _strict(log.path) == [{"step": 1, "loss": None, "grad_norm": None}]
    log.truncate_after(1)
    assert _strict(log.path) == [{"step": 1, "loss": None, "grad_norm": None}]


# -- 7. one process per run --------------------------------------------------------------------


def test_a_second_process_on_a_run_is_refused_and_a_killed_holder_releases_it(trained):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from llmkit.runs.lock import RunLock;"
            "RunLock(Path(sys.argv[1])).acquire(); print('locked', flush=True); time.sleep(600)",
            str(trained),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = (trained / "metrics.jsonl").read_text()
        with pytest.raises(RunInUse) as info:
            _resume(trained, "train.max_steps=6")
        assert str(info.value) == (
            f"{trained} is in use by another training process (pid {holder.pid}); "
            "wait for it to end or stop it"
        )
        assert (trained / "metrics.jsonl").read_text() == before
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert _resume(trained, "train.max_steps=6").step == 6  # the OS released the stale lock


def test_the_lock_is_held_for_the_run_and_released_after(tmp_path):
    run = tmp_path / "run"
    seen: list[bool] = []

    def log(_msg: str) -> None:
        if (run / LOCK_FILE).exists() and not seen:
            with pytest.raises(RunInUse):
                RunLock(run).acquire()
            seen.append(True)

    train(write_spec(tmp_path, max_steps=2, eval_interval=2), run_dir=run, log=log, progress=False)
    assert seen == [True]
    lock = RunLock(run)
    lock.acquire()  # free again
    lock.release()
    assert (run / LOCK_FILE).read_text().strip() == str(os.getpid())


def test_a_lock_file_alone_does_not_make_a_directory_a_run(tmp_path):
    RunLock(tmp_path).acquire()
    assert restartable(tmp_path)


def test_a_chat_runs_set_up_files_do_not_make_a_directory_a_run(tmp_path):
    """A run stopped before its first checkpoint leaves its set-up files, the chat
    template's tokenizer_config.json among them: a new run may start there."""
    for name in ("spec.yaml", "resolved.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text("{}")
    assert restartable(tmp_path)


def test_a_new_run_in_a_set_up_directory_makes_its_own_tokenizer(tmp_path):
    # A run that stopped in its data set-up (corpus too short) left a tokenizer of 6 symbols;
    # the rerun, on the lengthened corpus, must train its own, not reuse the stale one.
    from tests.helpers import write_train_spec

    run = tmp_path / "run"
    short = write_train_spec(tmp_path / "a", "abc abc\n", max_steps=2, eval_interval=2)
    with pytest.raises(LlmkitError):
        train(short, run_dir=run, **_quiet())
    assert restartable(run) and (run / "tokenizer.json").is_file()
    text = "the quick brown fox jumps over the lazy dog.\n" * 120
    spec = write_train_spec(tmp_path / "b", text, max_steps=2, eval_interval=2)
    train(spec, run_dir=run, **_quiet())
    from llmkit.data.tokenizer import Tokenizer

    tok = Tokenizer.load(run / "tokenizer.json")
    assert tok.decode(tok.encode("the lazy dog")) == "the lazy dog"


def test_a_second_start_leaves_a_run_in_its_set_up_untouched(tmp_path):
    # The first run holds the lock while it trains its tokenizer: a second start on the same
    # directory is refused before it clears anything.
    run = tmp_path / "run"
    run.mkdir()
    for name in ("spec.yaml", "resolved.json", "tokenizer.json"):
        (run / name).write_text("{}")
    lock = RunLock(run)
    lock.acquire()
    try:
        spec = write_spec(tmp_path, max_steps=2, eval_interval=2)
        with pytest.raises(RunInUse):
            train(spec, run_dir=run, **_quiet())
        assert sorted(p.name for p in run.iterdir()) == [
            LOCK_FILE,
            "resolved.json",
            "spec.yaml",
            "tokenizer.json",
        ]
    finally:
        lock.release()


# -- 9. permissions ----------------------------------------------------------------------------


def test_run_files_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        run = tmp_path / "run"
        train(write_spec(tmp_path, max_steps=2, eval_interval=2), run_dir=run, **_quiet())
    finally:
        os.umask(old)
    files = [run / "model.safetensors", *sorted((run / "checkpoints").rglob("*.*"))]
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in files if p.is_file()}
    assert set(modes.values()) == {"0o644"}, modes
