"""The lab tools' spellings and error messages (``benchmarks/``), without measuring anything."""

from __future__ import annotations

import pytest

from benchmarks import served_store


def test_served_store_refuses_a_missing_datastore_in_one_line_before_measuring(
        tmp_path, monkeypatch):
    monkeypatch.setattr(served_store, "measure", lambda *a, **k: pytest.fail("measured"))
    with pytest.raises(SystemExit) as exit_info:
        served_store.main(["--datastore", str(tmp_path / "missing"), "--tokens", "1000"])
    assert str(exit_info.value).startswith(
        f"error: datastore directory {tmp_path / 'missing'} does not exist")
