"""What ``atomic_path`` promises: the target appears under its name only complete, and a failure
leaves it as it was, with nothing beside it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllm_retrieval_spec.atomic import atomic_path


def test_a_file_and_a_directory_replace_their_targets_and_leave_nothing_beside(tmp_path):
    with atomic_path(tmp_path / "file") as temporary:
        temporary.write_text("new")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "old").write_text("old")
    with atomic_path(tmp_path / "dir") as temporary:
        temporary.mkdir()
        (temporary / "new").write_text("new")
    assert (tmp_path / "file").read_text() == "new"
    assert sorted(p.name for p in (tmp_path / "dir").iterdir()) == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "file"]


def test_a_dead_process_with_our_pid_left_a_temporary(tmp_path):
    leftover = tmp_path / f"dir.tmp-{os.getpid()}"
    leftover.mkdir()
    (leftover / "half").write_text("")
    with atomic_path(tmp_path / "dir") as temporary:
        temporary.mkdir()  # would fail on what was left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir"]
    assert list((tmp_path / "dir").iterdir()) == []


def test_a_failed_block_leaves_the_target_as_it_was(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "old").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(tmp_path / "dir") as temporary:
            temporary.mkdir()
            raise KeyboardInterrupt
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir"]
    assert (tmp_path / "dir" / "old").read_text() == "old"


def test_a_failed_rename_into_place_puts_the_old_directory_back(tmp_path, monkeypatch):
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "old").write_text("old")
    rename = Path.rename

    def failing_into_place(self, target):
        if ".tmp-" in self.name:
            raise OSError("rename failed")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", failing_into_place)
    with pytest.raises(OSError, match="rename failed"):
        with atomic_path(tmp_path / "dir") as temporary:
            temporary.mkdir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir"]
    assert (tmp_path / "dir" / "old").read_text() == "old"
