"""REST's index: a suffix array over the token stream, and the exact-match search on it.

The proposer calls ``SuffixArrayDatastore.lookup`` every decoding step, so the search is compiled
(numba) and works on plain arrays: the longest context suffix (``max_len`` down to ``min_len``
tokens, REST's Algorithm 1) that occurs in the stream, as the range of the suffix array holding
all its occurrences, and the tokens that follow a sample of those occurrences.

The suffix array sorts suffixes by int32 token value, so SEPARATOR (-1) sorts before every token
and a match, which only holds token ids, never runs over the end of a document.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numba
import numpy as np

from vllm_retrieval_spec.datastore.format import (
    SEPARATOR,
    Datastore,
    load_datastore,
    suffix_array_dtype,
)

#: REST's defaults: suffixes of 16 down to 2 tokens, continuations of 10 tokens (paper, sec. 5).
DEFAULT_MIN_LEN = 2
DEFAULT_MAX_LEN = 16
DEFAULT_MAX_OCCURRENCES = 64
DEFAULT_CONTINUATION_LEN = 10


def build_suffix_array(tokens: np.ndarray) -> np.ndarray:
    """The suffix array of an int32 token stream (any ids, separators included).

    libdivsufsort sorts bytes, so each token becomes a fixed-width big-endian string of its rank
    among the distinct values present (order-preserving, so byte order equals token order).
    Ranking first keeps the width at 2 bytes for most corpora even with vocabularies above
    65,536. Every step but numpy's ranking runs without the GIL (compiled with ``nogil``, and
    libdivsufsort through ctypes), so the served store's background rebuilds do not hold up
    drafting. Memory: the encoded text (width x n bytes) plus divsufsort's byte-level suffix array
    (4 x width x n bytes), compacted in place to the token-level one, which is then copied out
    (4 x n bytes more) when the byte-level array was longer.
    """
    from pydivsufsort import divsufsort

    n = len(tokens)
    if n == 0:
        return np.empty(0, dtype=np.int32)
    low, counts = _token_histogram(tokens)
    ranks = (np.cumsum(counts > 0) - 1).astype(np.int32)
    width = max(1, (int(ranks[-1]).bit_length() + 7) // 8)
    text = np.empty(n * width, dtype=np.uint8)
    _encode_big_endian(tokens, ranks, low, width, text)
    del ranks
    byte_sa = divsufsort(text)
    del text
    if width > 1:
        # Suffixes starting inside a token are dropped; the rest keep their relative order.
        _keep_token_starts(byte_sa, width)
    sa = byte_sa[:n]
    dtype = suffix_array_dtype(n)
    if sa.dtype == dtype and width == 1:
        return sa
    # A copy: a view would keep the whole byte-level array (width x n entries) alive for as
    # long as the result, which the served store holds until its next rebuild.
    return sa.astype(dtype)


@numba.njit(cache=True, nogil=True)
def _token_histogram(tokens: np.ndarray) -> tuple[int, np.ndarray]:
    """(smallest value, count of each value from the smallest to the largest)."""
    low = tokens[0]
    high = tokens[0]
    for t in tokens:
        low = min(low, t)
        high = max(high, t)
    counts = np.zeros(np.int64(high) - low + 1, dtype=np.int64)
    for t in tokens:
        counts[t - low] += 1
    return low, counts


@numba.njit(cache=True, nogil=True)
def _encode_big_endian(
    tokens: np.ndarray, ranks: np.ndarray, low: int, width: int, out: np.ndarray
) -> None:
    for i in range(tokens.shape[0]):
        r = ranks[tokens[i] - low]
        for b in range(width):
            out[i * width + b] = (r >> (8 * (width - 1 - b))) & 0xFF


@numba.njit(cache=True, nogil=True)
def _keep_token_starts(byte_sa: np.ndarray, width: int) -> int:
    j = 0
    for i in range(byte_sa.shape[0]):
        p = byte_sa[i]
        if p % width == 0:
            byte_sa[j] = p // width
            j += 1
    return j


@numba.njit(cache=True)
def _compare(tokens: np.ndarray, pos: int, context: np.ndarray, start: int, n: int) -> int:
    """Sign of (suffix at ``pos``) vs ``context[start:start + n]``, on at most n tokens."""
    size = tokens.shape[0]
    for k in range(n):
        if pos + k >= size:
            # The stream ends inside the pattern: a proper prefix sorts first.
            return -1
        t = tokens[pos + k]
        c = context[start + k]
        if t != c:
            return -1 if t < c else 1
    return 0


@numba.njit(cache=True)
def _find_any(
    tokens: np.ndarray, sa: np.ndarray, context: np.ndarray, start: int, n: int
) -> tuple[int, int, int]:
    """Binary search that stops at the first occurrence it meets.

    Returns (lo, hi, mid): every occurrence lies in sa[lo:hi] and sa[mid] is one, or mid = -1
    when there is none. Stopping early makes frequent patterns cheap; the exact range is only
    needed for the final match length (``_occurrence_range``).
    """
    lo = 0
    hi = sa.shape[0]
    while lo < hi:
        mid = (lo + hi) >> 1
        c = _compare(tokens, sa[mid], context, start, n)
        if c < 0:
            lo = mid + 1
        elif c > 0:
            hi = mid
        else:
            return lo, hi, mid
    return lo, hi, -1


@numba.njit(cache=True)
def _occurrence_range(
    tokens: np.ndarray,
    sa: np.ndarray,
    context: np.ndarray,
    start: int,
    n: int,
    lo: int,
    hi: int,
    mid: int,
) -> tuple[int, int]:
    """Exact [first, end) of the occurrences, given ``_find_any``'s bracket around one of them."""
    a = lo
    b = mid
    while a < b:
        m = (a + b) >> 1
        if _compare(tokens, sa[m], context, start, n) < 0:
            a = m + 1
        else:
            b = m
    first = a
    a = mid + 1
    b = hi
    while a < b:
        m = (a + b) >> 1
        if _compare(tokens, sa[m], context, start, n) <= 0:
            a = m + 1
        else:
            b = m
    return first, a


@numba.njit(cache=True)
def longest_suffix_match(
    tokens: np.ndarray, sa: np.ndarray, context: np.ndarray, min_len: int, max_len: int
) -> tuple[int, int, int]:
    """The longest suffix of ``context`` (``min_len``..``max_len`` tokens) found in ``tokens``.

    Returns (lo, hi, n): ``sa[lo:hi]`` are the start positions of all occurrences of
    ``context[-n:]``, or (0, 0, 0) when not even ``min_len`` tokens match. If a suffix occurs, so
    does every shorter one, so n is found by binary search (4 searches for REST's 2..16) and is
    exactly what REST's loop from 16 down to 2 returns.
    """
    m = context.shape[0]
    min_len = max(min_len, 1)
    # A negative id (padding, a separator) would let a match run over a document boundary.
    avail = 0
    while avail < m and avail < max_len and context[m - 1 - avail] >= 0:
        avail += 1
    if avail < min_len:
        return 0, 0, 0
    # Invariant: suffixes up to `known` tokens occur (min_len - 1 stands for "none yet"),
    # none longer than `limit` can.
    known = min_len - 1
    limit = avail
    lo = 0
    hi = 0
    mid = -1
    while known < limit:
        n = (known + limit + 1) >> 1
        probe_lo, probe_hi, probe_mid = _find_any(tokens, sa, context, m - n, n)
        if probe_mid >= 0:
            known = n
            lo = probe_lo
            hi = probe_hi
            mid = probe_mid
        else:
            limit = n - 1
    if known < min_len:
        return 0, 0, 0
    first, end = _occurrence_range(tokens, sa, context, m - known, known, lo, hi, mid)
    return first, end, known


@numba.njit(cache=True)
def copy_continuation(tokens: np.ndarray, start: int, out: np.ndarray) -> int:
    """Copies ``tokens[start:]`` into ``out`` until SEPARATOR, the end of the stream or a full
    ``out``; returns the number of tokens copied.

    Shared by REST's and DReSD's lookups. numba's cache does not follow calls into other
    modules: after changing this, clear the callers' caches too (their __pycache__/*.nbi, *.nbc).
    """
    size = tokens.shape[0]
    k = 0
    while k < out.shape[0] and start + k < size:
        t = tokens[start + k]
        if t == SEPARATOR:
            break
        out[k] = t
        k += 1
    return k


@numba.njit(cache=True)
def gather_continuations(
    tokens: np.ndarray,
    sa: np.ndarray,
    lo: int,
    hi: int,
    match_len: int,
    max_occurrences: int,
    continuation_len: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The tokens that follow up to ``max_occurrences`` occurrences in ``sa[lo:hi]``.

    With more occurrences than that, they are taken at even strides over the range. The range is
    sorted by what follows the match, so a strided sample keeps each continuation's share (and the
    result is deterministic). A continuation stops at SEPARATOR or at the end of the stream.

    Returns (cands int32 [m, continuation_len] padded with -1, lengths int32 [m]), one row per
    sampled occurrence (a row may have length 0 when the match ends a document).
    """
    count = max(hi - lo, 0)
    m = min(count, max(max_occurrences, 0))
    cands = np.full((m, continuation_len), SEPARATOR, dtype=np.int32)
    lengths = np.zeros(m, dtype=np.int32)
    for i in range(m):
        pos = np.int64(sa[lo + (np.int64(i) * count) // m]) + match_len
        lengths[i] = copy_continuation(tokens, pos, cands[i])
    return cands, lengths


@numba.njit(cache=True)
def _lookup(
    tokens: np.ndarray,
    sa: np.ndarray,
    context: np.ndarray,
    min_len: int,
    max_len: int,
    max_occurrences: int,
    continuation_len: int,
) -> tuple[np.ndarray, np.ndarray, int]:
    # One compiled call per lookup: each numba dispatch costs about a microsecond.
    lo, hi, n = longest_suffix_match(tokens, sa, context, min_len, max_len)
    cands, lengths = gather_continuations(tokens, sa, lo, hi, n, max_occurrences, continuation_len)
    return cands, lengths, n


@numba.njit(cache=True)
def _followers(tokens: np.ndarray, sa: np.ndarray, last: np.ndarray,
               max_samples: int) -> tuple[np.ndarray, bool]:
    lo, hi, mid = _find_any(tokens, sa, last, 0, 1)
    if mid < 0:
        return np.empty(0, dtype=np.int32), True
    first, end = _occurrence_range(tokens, sa, last, 0, 1, lo, hi, mid)
    count = end - first
    m = min(count, max(max_samples, 0))
    out = np.empty(m, dtype=np.int32)
    size = tokens.shape[0]
    k = 0
    for i in range(m):
        pos = np.int64(sa[first + (np.int64(i) * count) // m]) + 1
        if pos < size and tokens[pos] != SEPARATOR:
            out[k] = tokens[pos]
            k += 1
    return out[:k], count <= m


def suffix_followers(tokens: np.ndarray, sa: np.ndarray, last_token: int,
                     max_samples: int) -> tuple[np.ndarray, bool]:
    """The tokens after occurrences of ``last_token`` (repeats kept), from at most
    ``max_samples`` occurrences at even strides over its suffix-array range, and whether that
    was every occurrence. The range is sorted by the next token, so the sample keeps each
    follower's share (as ``gather_continuations`` does)."""
    return _followers(tokens, sa, np.full(1, last_token, dtype=np.int32), max_samples)


class SuffixArrayDatastore:
    """REST lookups on a loaded datastore."""

    def __init__(self, datastore: Datastore) -> None:
        self.datastore = datastore
        # Plain ndarray views of the memory maps: numba dispatches np.memmap arguments about
        # 2 us slower per call, and the views share the mapped pages (no copy).
        self._tokens = np.asarray(datastore.tokens)
        self._sa = np.asarray(datastore.suffix_array)
        # Compile (or load from numba's cache) now rather than in the first decoding step.
        self.lookup(np.zeros(DEFAULT_MIN_LEN, dtype=np.int32))

    @classmethod
    def from_path(
        cls,
        path: str | Path,
        expected_fingerprint: str | None = None,
        verify_checksums: bool = True,
    ) -> SuffixArrayDatastore:
        return cls(
            load_datastore(
                path,
                expected_fingerprint=expected_fingerprint,
                verify_checksums=verify_checksums,
            )
        )

    def lookup(
        self,
        context: np.ndarray | Sequence[int],
        *,
        min_len: int = DEFAULT_MIN_LEN,
        max_len: int = DEFAULT_MAX_LEN,
        max_occurrences: int = DEFAULT_MAX_OCCURRENCES,
        continuation_len: int = DEFAULT_CONTINUATION_LEN,
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """Continuations of the longest matching suffix of ``context`` (REST's retrieval).

        Returns (cands int32 [m, continuation_len] padded with -1, lengths int32 [m], match
        length); m = 0 and match length 0 when fewer than ``min_len`` tokens match.
        """
        return suffix_lookup(self._tokens, self._sa, context, min_len=min_len, max_len=max_len,
                             max_occurrences=max_occurrences, continuation_len=continuation_len)

    def followers(self, last_token: int, max_samples: int) -> tuple[np.ndarray, bool]:
        """``suffix_followers`` in this datastore."""
        return suffix_followers(self._tokens, self._sa, last_token, max_samples)


def suffix_lookup(
    tokens: np.ndarray,
    sa: np.ndarray,
    context: np.ndarray | Sequence[int],
    *,
    min_len: int,
    max_len: int,
    max_occurrences: int,
    continuation_len: int,
) -> tuple[np.ndarray, np.ndarray, int]:
    """REST's retrieval on any token stream and its suffix array (a datastore's memory maps, or
    the served store's in-memory snapshot): see ``SuffixArrayDatastore.lookup``."""
    # Only the last max_len tokens can take part in a match; converting them is cheap.
    suffix = np.ascontiguousarray(context[-max_len:], dtype=np.int32)
    cands, lengths, n = _lookup(tokens, sa, suffix, min_len, max_len, max_occurrences,
                                continuation_len)
    return cands, lengths, int(n)
