"""Datastores are served from shared, memory-mapped pages: several readers share one copy, and a
store larger than a process's memory limit still serves (the kernel evicts clean pages)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from vllm_retrieval_spec.datastore import SuffixArrayDatastore, build_datastore_from_token_ids

MIB = 1 << 20


@pytest.fixture(scope="module")
def large_store(tmp_path_factory) -> Path:
    """16 M tokens: 64 MiB of tokens and 64 MiB of suffix array."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("sharing") / "store"
    documents = (rng.integers(0, 1000, 1 << 20, dtype=np.int32) for _ in range(16))
    build_datastore_from_token_ids(documents, path, tokenizer_name="t",
                                   tokenizer_fingerprint="0" * 64, vocab_size=1000,
                                   progress=False)
    return path


READER = textwrap.dedent("""
    import sys
    import numpy as np
    from vllm_retrieval_spec.datastore import SuffixArrayDatastore

    store = SuffixArrayDatastore.from_path(sys.argv[1], verify_checksums=False)
    tokens, sa = store._tokens, store._sa
    # Touch every page, as lookups over a long run would, then look something up.
    total = sum(int(a[i:i + (1 << 22)].sum()) for a in (tokens, sa)
                for i in range(0, len(a), 1 << 22))
    cands, lengths, n = store.lookup(np.asarray(tokens[1000:1016]), continuation_len=4)
    print(n, cands[0].tolist(), flush=True)
    if len(sys.argv) > 2:  # report this process's mapping of tokens.npy
        text = open("/proc/self/smaps").read()
        block = text.split("tokens.npy")[1].split("VmFlags")[0]
        fields = {line.split(":")[0]: int(line.split()[1]) for line in block.splitlines()[1:]
                  if line.strip().endswith("kB")}
        print(fields["Rss"], fields["Shared_Clean"] + fields["Shared_Dirty"], fields["Pss"],
              flush=True)
""")


def run_reader(store: Path, *extra: str, preexec_fn=None) -> list[str]:
    result = subprocess.run([sys.executable, "-c", READER, str(store), *extra],
                            capture_output=True, text=True, timeout=300, preexec_fn=preexec_fn)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.splitlines()


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_concurrent_readers_share_the_mapped_pages(large_store):
    store = SuffixArrayDatastore.from_path(large_store, verify_checksums=False)
    assert int(np.asarray(store._tokens).sum()) > 0  # this process maps every page too
    rss_kb, shared_kb, pss_kb = map(int, run_reader(large_store, "--smaps")[1].split())
    # The reader's 64 MiB of tokens are resident, all of it shared with this process: one copy
    # in memory, half of it charged to each (proportional set size).
    assert rss_kb >= 60 * 1024
    assert shared_kb >= 0.95 * rss_kb
    assert pss_kb <= 0.55 * rss_kb


CGROUP = Path("/sys/fs/cgroup/memory")


def _memory_cgroup(limit_bytes: int) -> Path | None:
    """A cgroup-v1 memory group with a hard limit, or None where we may not make one."""
    group = CGROUP / f"vllm-rsd-test-{os.getpid()}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
    except OSError:
        return None
    return group


def drop_from_page_cache(store: Path) -> None:
    """Pages already cached stay charged to whoever read them first; evict them so that the
    reader's own faults are charged to its group."""
    for file in store.glob("*.npy"):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def test_a_store_larger_than_the_memory_limit_still_serves(large_store):
    # The reader (Python, numpy, numba) needs about 70 MiB of its own; the store is 128 MiB and
    # the limit leaves room for a fraction of it, so the reader can only finish if the kernel
    # evicts mapped pages it has read and maps them again when needed.
    limit = 100 * MIB
    group = _memory_cgroup(limit)
    if group is None:
        pytest.skip("needs a writable cgroup-v1 memory controller (root)")
    try:
        drop_from_page_cache(large_store)
        lines = run_reader(large_store, preexec_fn=lambda: (group / "cgroup.procs").write_text(
            str(os.getpid())))
        assert int(lines[0].split()[0]) == 16  # the whole 16-token suffix was found
        assert int((group / "memory.max_usage_in_bytes").read_text()) <= limit
        # The limit was reached and pages were reclaimed, not the reader.
        assert int((group / "memory.failcnt").read_text()) > 0
    finally:
        group.rmdir()
