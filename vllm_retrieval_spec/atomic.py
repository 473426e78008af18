"""Files and directories that appear under their final name only once complete.

Everything this project writes for later runs to trust (datastores, manifests, converted models,
extracted wheel members, corpora) is written under a temporary sibling name and renamed into
place, so an interrupted or failed run never leaves something that looks valid. A killed one
(SIGKILL, the OOM killer) leaves its temporaries, which the next datastore build of the same
output names (``report_abandoned``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(target: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling path of ``target`` for the block to create (a file or a
    directory). When the block succeeds it takes ``target``'s place, replacing what was there
    (an existing directory is moved aside, then removed); when it raises (KeyboardInterrupt
    included) it is removed and ``target`` is left as it was."""
    target = Path(target)
    temporary = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    # Only a dead process with our pid can have left this behind.
    _remove(temporary)
    try:
        yield temporary
        if target.is_dir() and not target.is_symlink():
            # os.replace cannot replace a non-empty directory.
            old = target.with_name(f"{target.name}.old-{os.getpid()}")
            target.rename(old)
            try:
                temporary.rename(target)
            except BaseException:
                old.rename(target)
                raise
            shutil.rmtree(old)
        else:
            os.replace(temporary, target)
    finally:
        _remove(temporary)


def abandoned(target: str | Path) -> list[Path]:
    """What ``atomic_path(target)`` left beside ``target`` in processes no longer running on this
    host: one killed by SIGKILL or the kernel's OOM killer removes nothing. Nothing reads such a
    path, but it can hold gigabytes (a dense build's hidden states: 4 x hidden size bytes a
    token). Another host writing the same directory may own one, so it is named, not removed."""
    target = Path(target)
    name = re.compile(rf"{re.escape(target.name)}\.(?:tmp|old)-(\d+)")
    try:
        siblings = list(target.parent.iterdir())
    except OSError:
        return []
    return sorted(path for path in siblings if (match := name.fullmatch(path.name))
                  and int(match[1]) != os.getpid() and not pid_alive(int(match[1])))


def report_abandoned(target: str | Path) -> None:
    """One line on stderr for each of ``abandoned(target)``, with its size and how to remove it."""
    for path in abandoned(target):
        pid = path.name.rsplit("-", 1)[1]
        size = _size(path)
        shown = f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
        print(f"note: {path} ({shown}) was left by process {pid}, which "
              f"is no longer running (killed before it could clean up); nothing reads it: "
              f"rm -r '{path}' unless a build on another host is writing it", file=sys.stderr)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _size(path: Path) -> int:
    if not path.is_dir() or path.is_symlink():
        return path.lstat().st_size
    return sum(file.lstat().st_size for file in path.rglob("*") if not file.is_dir())


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
