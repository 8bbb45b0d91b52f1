"""Shared data lookup: the env var wins, a missing file names where it looked."""

from __future__ import annotations

import pytest

from kvtier.data import SHAKESPEARE, shared_data_file


def test_env_var_wins(tmp_path, monkeypatch):
    (tmp_path / SHAKESPEARE).write_text("to be")
    monkeypatch.setenv("KVTIER_SHARED_DATA", str(tmp_path))
    assert shared_data_file(SHAKESPEARE) == tmp_path / SHAKESPEARE


def test_missing_file_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_SHARED_DATA", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no-such.txt not found.*KVTIER_SHARED_DATA"):
        shared_data_file("no-such.txt")


def test_finds_the_real_shared_folder():
    assert shared_data_file(SHAKESPEARE).stat().st_size > 1_000_000
