"""Library progress bars (``datasets``' "tokenizing train: 40%|...", ``tokenizers``,
``huggingface_hub``) draw on a terminal only: off one (a pipe, a log file) their
carriage-return redraws would fill the log."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets.config
import datasets.utils
import pytest

from llmkit.data import prepare as data_prepare
from llmkit.data import prepare_data
from llmkit.data import tokenizer as tok_mod
from tests.data.test_data import TEXT, make_rs


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.fixture
def bars_allowed() -> None:
    """The test needs datasets' bars on to start with (no HF_DATASETS_DISABLE_PROGRESS_BARS)."""
    if datasets.config.HF_DATASETS_DISABLE_PROGRESS_BARS or (
        datasets.utils.are_progress_bars_disabled()
    ):
        pytest.skip("datasets' progress bars are disabled in this environment")


def test_prepare_off_a_terminal_draws_no_progress_bar(corpus, tmp_path, capfd, bars_allowed):
    lines: list[str] = []
    prepare_data(make_rs([corpus]), tmp_path / "run", log=lines.append)
    err = capfd.readouterr().err
    assert "\r" not in err and "tokenizing" not in err, err
    assert any(line.startswith("data: train:") for line in lines)
    assert not datasets.utils.are_progress_bars_disabled()  # turned back on afterwards


def test_prepare_on_a_terminal_keeps_the_bars(corpus, tmp_path, capfd, monkeypatch, bars_allowed):
    monkeypatch.setattr(data_prepare, "on_terminal", lambda: True)
    prepare_data(make_rs([corpus]), tmp_path / "run", log=lambda _m: None)
    err = capfd.readouterr().err
    assert "tokenizing train" in err and "tokenizing validation" in err


def test_library_progress_bars_restores_only_what_it_turned_off(bars_allowed):
    import huggingface_hub.utils as hub

    with data_prepare.library_progress_bars(enabled=False):
        assert datasets.utils.are_progress_bars_disabled()
        assert hub.are_progress_bars_disabled()
        with data_prepare.library_progress_bars(enabled=False):
            pass
        assert datasets.utils.are_progress_bars_disabled()  # the inner one left it off
    assert not datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()  # off by the user: left off
    try:
        with data_prepare.library_progress_bars(enabled=False):
            pass
        assert datasets.utils.are_progress_bars_disabled()
    finally:
        datasets.utils.enable_progress_bars()


@pytest.mark.parametrize("terminal", [False, True])
def test_bpe_training_shows_tokenizers_progress_on_a_terminal_only(monkeypatch, terminal):
    import tokenizers.trainers

    seen: list[Any] = []
    real = tokenizers.trainers.BpeTrainer

    def spy(**kwargs: Any) -> Any:
        seen.append(kwargs.get("show_progress"))
        return real(**{**kwargs, "show_progress": False})

    monkeypatch.setattr(tokenizers.trainers, "BpeTrainer", spy)
    monkeypatch.setattr(tok_mod, "on_terminal", lambda: terminal)
    tok_mod.train_bpe(["the cat sat on the mat"] * 20, 300)
    assert seen == [terminal]
    tok_mod.train_bpe(["the cat"] * 20, 300, show_progress=False)
    assert seen[-1] is False
