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


def dead_pid() -> int:
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_what_killed_processes_left_is_named_with_its_size_and_kept(tmp_path, capsys):
    # A process killed by SIGKILL or the OOM killer removes nothing; its temporaries (a dense
    # build's states: gigabytes) stayed unnoticed beside the output for good.
    from vllm_retrieval_spec.atomic import abandoned, report_abandoned

    pid = dead_pid()
    tmp, old = tmp_path / f"ds.tmp-{pid}", tmp_path / f"ds.old-{pid}"
    tmp.mkdir()
    (tmp / "tokens.npy").write_bytes(bytes(3 * 2**20))
    old.write_bytes(b"x")
    for other in (f"ds.tmp-{os.getpid()}", f"ds.tmp-{os.getppid()}", f"ds2.tmp-{pid}",
                  f"ds.tmp-{pid}x", "ds"):
        (tmp_path / other).mkdir()  # ours, a live process's, another target's, not a temporary
    assert abandoned(tmp_path / "ds") == [old, tmp]
    report_abandoned(tmp_path / "ds")
    lines = capsys.readouterr().err.splitlines()
    assert lines[1] == (f"note: {tmp} (3.0 MiB) was left by process {pid}, which is no longer "
                        f"running (killed before it could clean up); nothing reads it: "
                        f"rm -r '{tmp}' unless a build on another host is writing it")
    assert lines[0].startswith(f"note: {old} (0.0 MiB)") and len(lines) == 2
    assert tmp.is_dir() and old.is_file()
    assert abandoned(tmp_path / "absent" / "ds") == []
