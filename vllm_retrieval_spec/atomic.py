"""Files and directories that appear under their final name only once complete.

Everything this project writes for later runs to trust (datastores, manifests, converted models,
extracted wheel members, corpora) is written under a temporary sibling name and renamed into
place, so an interrupted or failed run never leaves something that looks valid.
"""

from __future__ import annotations

import contextlib
import os
import shutil
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


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
