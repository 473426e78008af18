"""REST's suffix-array index: construction and search, checked against brute-force oracles."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import brute_force_match
from vllm_retrieval_spec.datastore.format import SEPARATOR
from vllm_retrieval_spec.datastore.suffix_array import (
    build_suffix_array,
    copy_continuation,
    gather_continuations,
    longest_suffix_match,
)


def suffix_array_reference(tokens: np.ndarray) -> np.ndarray:
    """Prefix doubling in numpy: sort by (rank of the first k tokens, rank of the next k)."""
    n = len(tokens)
    if n == 0:
        return np.empty(0, dtype=np.int64)
    rank = np.unique(tokens, return_inverse=True)[1].astype(np.int64).reshape(-1)
    k = 1
    while True:
        # A suffix that ends first sorts first: -1 is below every rank.
        second = np.full(n, -1, dtype=np.int64)
        if k < n:
            second[: n - k] = rank[k:]
        order = np.lexsort((second, rank))
        changed = (rank[order][1:] != rank[order][:-1]) | (second[order][1:] != second[order][:-1])
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.concatenate([[0], np.cumsum(changed)])
        if rank[order[-1]] == n - 1 or k >= n:
            return order
        k *= 2


def realistic_stream(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    """Zipf-distributed ids with repeated phrases and document separators, like tokenised code."""
    phrases = [
        np.minimum(rng.zipf(1.3, size=rng.integers(2, 12)), vocab - 1).astype(np.int32)
        for _ in range(200)
    ]
    parts: list[np.ndarray] = []
    total = 0
    while total < n:
        if rng.random() < 0.5:
            part = phrases[min(int(rng.zipf(1.5)) - 1, len(phrases) - 1)]
        else:
            part = np.minimum(rng.zipf(1.2, size=rng.integers(1, 8)), vocab - 1).astype(np.int32)
        if rng.random() < 0.05:
            part = np.append(part, SEPARATOR).astype(np.int32)
        parts.append(part)
        total += len(part)
    return np.concatenate(parts)[:n].astype(np.int32)


@pytest.mark.parametrize(
    "n, high, sep_rate",
    [(1, 5, 0.0), (50, 2, 0.2), (500, 4, 0.1), (2000, 300, 0.05), (3000, 200_000, 0.05)],
)
def test_suffix_array_matches_reference_on_random_streams(n, high, sep_rate):
    rng = np.random.default_rng(n)
    tokens = rng.integers(0, high, size=n).astype(np.int32)
    tokens[rng.random(n) < sep_rate] = SEPARATOR
    sa = build_suffix_array(tokens)
    assert sa.dtype == np.int32
    np.testing.assert_array_equal(sa, suffix_array_reference(tokens))


def test_suffix_array_with_more_than_65536_distinct_ids():
    # Needs 3 bytes per token after ranking: the widest encoding path.
    rng = np.random.default_rng(1)
    tokens = rng.permutation(np.arange(70_000, 70_000 + 100_000, dtype=np.int32))
    tokens = np.concatenate([tokens, tokens[:5000], [SEPARATOR], tokens[:100]]).astype(np.int32)
    np.testing.assert_array_equal(build_suffix_array(tokens), suffix_array_reference(tokens))


def test_suffix_array_on_realistic_stream():
    tokens = realistic_stream(np.random.default_rng(2), 50_000, 49_152)
    np.testing.assert_array_equal(build_suffix_array(tokens), suffix_array_reference(tokens))


@pytest.mark.parametrize("high", [300, 200_000])
def test_suffix_array_keeps_no_byte_level_array_alive(high):
    """With 2 or 3 bytes per token, divsufsort's array is 2 or 3 times the result: the result
    must not be a view of it (the served store holds its index for the process's life)."""
    tokens = np.random.default_rng(3).integers(0, high, size=1000).astype(np.int32)
    sa = build_suffix_array(tokens)
    held = sa if sa.base is None else sa.base
    assert np.asarray(held).nbytes == sa.nbytes


def test_suffix_array_of_empty_stream():
    assert build_suffix_array(np.empty(0, dtype=np.int32)).shape == (0,)


# Hand-made stream: "5 6" occurs at 0, 5, 11 and 15; "1 5 6 7 8" only at 14.
#        0  1  2  3   4  5  6  7  8  9  10 11 12  13 14 15 16 17 18 19
HAND = [5, 6, 7, 8, -1, 5, 6, 7, 9, 9, -1, 5, 6, -1, 1, 5, 6, 7, 8, 2]


@pytest.fixture
def hand() -> tuple[np.ndarray, np.ndarray]:
    tokens = np.array(HAND, dtype=np.int32)
    return tokens, build_suffix_array(tokens)


def test_longest_match_on_hand_made_stream(hand):
    tokens, sa = hand
    lo, hi, n = longest_suffix_match(tokens, sa, np.array([3, 1, 5, 6, 7, 8], np.int32), 2, 16)
    assert (n, sorted(sa[lo:hi])) == (5, [14])
    lo, hi, n = longest_suffix_match(tokens, sa, np.array([4, 5, 6], np.int32), 2, 16)
    assert (n, sorted(sa[lo:hi])) == (2, [0, 5, 11, 15])
    # max_len caps the match even though a longer suffix occurs.
    lo, hi, n = longest_suffix_match(tokens, sa, np.array([3, 1, 5, 6, 7, 8], np.int32), 2, 3)
    assert (n, sorted(sa[lo:hi])) == (3, [1, 16])


def test_longest_match_none_and_short_context(hand):
    tokens, sa = hand
    assert longest_suffix_match(tokens, sa, np.array([9, 5], np.int32), 2, 16) == (0, 0, 0)
    # One token matches, but fewer than min_len is no match.
    assert longest_suffix_match(tokens, sa, np.array([6], np.int32), 2, 16) == (0, 0, 0)
    assert longest_suffix_match(tokens, sa, np.array([], np.int32), 2, 16) == (0, 0, 0)
    lo, hi, n = longest_suffix_match(tokens, sa, np.array([6], np.int32), 1, 16)
    assert (n, sorted(sa[lo:hi])) == (1, [1, 6, 12, 16])


def test_longest_match_never_crosses_a_separator(hand):
    tokens, sa = hand
    # "8 -1 5 6" occurs in the stream, but the match must stop at the context's negative id.
    lo, hi, n = longest_suffix_match(tokens, sa, np.array([8, -1, 5, 6], np.int32), 2, 16)
    assert (n, sorted(sa[lo:hi])) == (2, [0, 5, 11, 15])
    assert longest_suffix_match(tokens, sa, np.array([6, -1], np.int32), 1, 16) == (0, 0, 0)


@pytest.mark.parametrize("alphabet", [2, 3, 6])
def test_longest_match_matches_brute_force(alphabet):
    rng = np.random.default_rng(alphabet)
    for _ in range(20):
        tokens = rng.integers(0, alphabet, size=rng.integers(1, 400)).astype(np.int32)
        tokens[rng.random(len(tokens)) < 0.08] = SEPARATOR
        sa = build_suffix_array(tokens)
        for _ in range(20):
            if rng.random() < 0.5:
                # A piece of the stream itself (separators removed), so long matches happen.
                start = rng.integers(0, len(tokens))
                context = tokens[start : start + rng.integers(0, 24)]
                context = context[context != SEPARATOR]
            else:
                context = rng.integers(0, alphabet + 1, size=rng.integers(0, 24)).astype(np.int32)
            min_len = int(rng.integers(1, 4))
            max_len = int(rng.integers(min_len, 20))
            lo, hi, n = longest_suffix_match(tokens, sa, context, min_len, max_len)
            expected_n, expected_positions = brute_force_match(tokens, context, min_len, max_len)
            assert n == expected_n
            assert set(sa[lo:hi].tolist()) == expected_positions
            assert hi - lo == len(expected_positions)


def test_gather_continuations_exact(hand):
    tokens, sa = hand
    lo, hi, n = longest_suffix_match(tokens, sa, np.array([5, 6], np.int32), 2, 16)
    cands, lengths = gather_continuations(tokens, sa, lo, hi, n, 64, 4)
    # The suffix array orders occurrences by what follows them: 11, 0, 15, 5. Continuations
    # stop at a separator (after 11 at once, after 0 and 5) or at the end of the stream (15).
    np.testing.assert_array_equal(
        cands, [[-1, -1, -1, -1], [7, 8, -1, -1], [7, 8, 2, -1], [7, 9, 9, -1]]
    )
    np.testing.assert_array_equal(lengths, [0, 2, 3, 3])
    assert cands.dtype == np.int32 and lengths.dtype == np.int32

    # More occurrences than max_occurrences: evenly strided over the range.
    cands, lengths = gather_continuations(tokens, sa, lo, hi, n, 2, 4)
    np.testing.assert_array_equal(cands, [[-1, -1, -1, -1], [7, 8, 2, -1]])
    np.testing.assert_array_equal(lengths, [0, 3])

    cands, lengths = gather_continuations(tokens, sa, lo, hi, n, 64, 1)
    np.testing.assert_array_equal(cands[:, 0], [-1, 7, 7, 7])
    np.testing.assert_array_equal(lengths, [0, 1, 1, 1])

    lo, hi, n = longest_suffix_match(tokens, sa, np.array([3, 1, 5, 6, 7, 8], np.int32), 2, 16)
    cands, lengths = gather_continuations(tokens, sa, lo, hi, n, 64, 4)
    np.testing.assert_array_equal(cands, [[2, -1, -1, -1]])
    np.testing.assert_array_equal(lengths, [1])


def test_copy_continuation_stops_at_separator_end_or_full_row():
    tokens = np.array([4, 5, 6, -1, 7, 8], dtype=np.int32)
    out = np.full(3, -1, dtype=np.int32)
    assert copy_continuation(tokens, 1, out) == 2 and out.tolist() == [5, 6, -1]
    out = np.full(3, -1, dtype=np.int32)
    assert copy_continuation(tokens, 4, out) == 2 and out.tolist() == [7, 8, -1]
    out = np.full(2, -1, dtype=np.int32)
    assert copy_continuation(tokens, 0, out) == 2 and out.tolist() == [4, 5]
    assert copy_continuation(tokens, 3, out) == 0 and copy_continuation(tokens, 6, out) == 0


def test_gather_continuations_without_match(hand):
    tokens, sa = hand
    cands, lengths = gather_continuations(tokens, sa, 0, 0, 0, 64, 10)
    assert cands.shape == (0, 10) and lengths.shape == (0,)


def test_gather_continuations_stride_is_even_and_deterministic():
    tokens = np.array([1, 2] * 100 + [-1], dtype=np.int32)
    sa = build_suffix_array(tokens)
    lo, hi, n = longest_suffix_match(tokens, sa, np.array([1, 2], np.int32), 2, 2)
    assert hi - lo == 100
    first = gather_continuations(tokens, sa, lo, hi, n, 10, 3)
    second = gather_continuations(tokens, sa, lo, hi, n, 10, 3)
    np.testing.assert_array_equal(first[0], second[0])
    # Occurrences sorted by continuation: the last one (followed by -1) first, then by how much
    # of "1 2 1 2 ..." remains; every 10th of them is taken.
    np.testing.assert_array_equal(first[1], [0, 3, 3, 3, 3, 3, 3, 3, 3, 3])


def test_real_tokens_against_the_oracles(tokenizer):
    """SmolLM2 tokens of standard-library code: index and search agree with brute force."""
    import json
    from pathlib import Path

    def encode(path: Path) -> list[int]:
        return tokenizer(path.read_text(), add_special_tokens=False)["input_ids"]

    package = Path(json.__file__).parent
    tokens = np.array(encode(package / "decoder.py") + [SEPARATOR] + encode(package / "encoder.py"),
                      dtype=np.int32)
    sa = build_suffix_array(tokens)
    np.testing.assert_array_equal(sa, suffix_array_reference(tokens))
    held_out = encode(package / "scanner.py")
    matched = 0
    for end in range(16, len(held_out), 7):
        context = np.array(held_out[end - 16:end], dtype=np.int32)
        lo, hi, n = longest_suffix_match(tokens, sa, context, 2, 16)
        expected_n, expected_positions = brute_force_match(tokens, context, 2, 16)
        assert (n, set(sa[lo:hi].tolist())) == (expected_n, expected_positions)
        matched += n > 0
    assert matched > 10  # real code shares phrasing, so the comparison covers real matches
