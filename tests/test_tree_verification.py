"""Tree verification's pure parts: depths, the walk (along the target's argmax, or its draws
for sampled requests), the KV moves, who gets a tree, and reading vLLM-CPU's paged KV cache
(checked against vLLM's own writer)."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_retrieval_spec.verification.core import (
    batched_greedy_walk,
    greedy_tree_walk,
    is_chain,
    leading_chain_len,
    path_moves,
    root_path,
    takes_argmax,
    tree_depths,
    tree_eligible,
    valid_tree,
)

#        root
#       /    \
#     0:a    1:b
#     /  \     \
#   2:c  3:d   4:e
#         |
#        5:f
PARENTS = np.array([-1, -1, 0, 0, 1, 3])
TOKENS = np.array([10, 11, 12, 13, 14, 15])


def test_depths_count_from_the_root():
    assert tree_depths(PARENTS).tolist() == [1, 1, 2, 2, 2, 3]
    assert tree_depths(np.arange(4) - 1).tolist() == [1, 2, 3, 4]


def test_chains_and_valid_trees():
    assert is_chain(np.arange(5) - 1)
    assert not is_chain(PARENTS)
    assert valid_tree(PARENTS)
    assert not valid_tree(np.array([-1, 1]))     # its own parent
    assert not valid_tree(np.array([0, -1]))     # parent after child
    assert not valid_tree(np.array([-1, -2]))


def target_after(tokens_by_node: dict[int, int]) -> np.ndarray:
    """The target's token after the root (key -1) and after each node; 99 where unspecified."""
    target = np.full(len(PARENTS) + 1, 99)
    for node, token in tokens_by_node.items():
        target[node + 1] = token
    return target


@pytest.mark.parametrize("target, path, bonus", [
    ({-1: 10, 0: 13, 3: 15, 5: 7}, [0, 3, 5], 7),     # the deepest path, through a 2nd child
    ({-1: 11, 1: 14, 4: 8}, [1, 4], 8),                 # the root's second child
    ({-1: 10, 0: 12}, [0, 2], 99),                      # a leaf: the bonus comes after it
    ({-1: 42}, [], 42),                                 # nothing accepted: the bonus only
])
def test_greedy_walk_follows_the_targets_tokens(target, path, bonus):
    assert greedy_tree_walk(PARENTS, TOKENS, target_after(target)) == (path, bonus)


def random_trie(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A tree of ``n`` nodes in topological order whose siblings hold different tokens (from a
    vocabulary of 4, so that targets often agree), as the drafters' tries do."""
    parents, tokens = [], []
    for i in range(n):
        parent = int(rng.integers(-1, i)) if i else -1
        taken = {t for p, t in zip(parents, tokens) if p == parent}
        free = [t for t in range(4) if t not in taken]
        if not free:
            parent, free = i - 1, list(range(4))   # a full node: extend the last one instead
        parents.append(parent)
        tokens.append(int(rng.choice(free)))
    return np.array(parents, dtype=np.int64), np.array(tokens, dtype=np.int64)


def test_batched_walk_is_the_greedy_walk_of_every_tree():
    """Trees of 1-40 nodes padded into one batch, targets drawn from the same 4 tokens: the
    batched walk finds each tree's greedy path (its deepest node) and bonus."""
    import torch

    rng = np.random.default_rng(0)
    for _ in range(20):
        trees = [random_trie(rng, int(rng.integers(1, 41))) for _ in range(int(rng.integers(1, 6)))]
        nodes = max(len(p) for p, _ in trees)
        parents, depths, tokens = (np.zeros((len(trees), nodes), np.int64) for _ in range(3))
        targets = rng.integers(0, 4, size=(len(trees), nodes + 1))
        for b, (p, t) in enumerate(trees):
            parents[b, :len(p)], depths[b, :len(p)], tokens[b, :len(p)] = p, tree_depths(p), t
        last, bonus = batched_greedy_walk(*map(torch.from_numpy, (parents, depths, tokens,
                                                                  targets)),
                                          int(depths.max())).numpy()
        for b, (p, t) in enumerate(trees):
            path, expected_bonus = greedy_tree_walk(p, t, targets[b, :len(p) + 1])
            assert (root_path(p, int(last[b])), int(bonus[b])) == (path, expected_bonus)


@pytest.mark.parametrize("parents, length", [([], 0), ([-1], 1), ([-1, 0, 1], 3),
                                              ([-1, 0, 0, 2], 2), ([-1, -1, 1], 1),
                                              (PARENTS.tolist(), 1), ([-1, 0, 1, 1, 2], 3)])
def test_leading_chain_len_counts_the_nodes_whose_earlier_nodes_are_all_ancestors(parents,
                                                                                  length):
    assert leading_chain_len(np.array(parents, dtype=np.int64)) == length


def test_greedy_walk_on_a_chain_is_the_common_prefix():
    parents = np.arange(4) - 1
    tokens = np.array([5, 6, 7, 8])
    assert greedy_tree_walk(parents, tokens, np.array([5, 6, 0, 0, 0])) == ([0, 1], 0)


def test_path_moves_put_the_kth_path_node_after_the_root():
    # Node j sits at offset j + 1 after the root; the k-th path node belongs at offset k + 1.
    assert path_moves([0, 3, 5]) == [(4, 2), (6, 3)]
    assert path_moves([1, 4]) == [(2, 1), (5, 2)]
    assert path_moves([0, 1, 2]) == []


def test_path_moves_never_read_an_overwritten_slot():
    rng = np.random.default_rng(0)
    for _ in range(200):
        path = sorted(rng.choice(30, size=rng.integers(1, 10), replace=False).tolist())
        slots = list(range(32))
        for src, dst in path_moves(path):
            slots[dst] = slots[src]
        assert slots[1:len(path) + 1] == [node + 1 for node in path]


class Params:
    """The SamplingParams fields that decide."""
    temperature = 0.0
    min_p = 0.0
    logprobs = None
    presence_penalty = 0.0
    frequency_penalty = 0.0
    repetition_penalty = 1.0
    min_tokens = 0
    logit_bias = None
    allowed_token_ids = None
    bad_words = None
    structured_outputs = None
    thinking_token_budget = None


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("field, value", [
    ("logprobs", 2), ("presence_penalty", 0.5), ("frequency_penalty", 0.1),
    ("repetition_penalty", 1.2), ("min_tokens", 4), ("logit_bias", {3: 1.0}),
    ("allowed_token_ids", [1, 2]), ("bad_words", ["x"]), ("structured_outputs", object()),
    ("thinking_token_budget", 10),
])
def test_requests_with_anything_on_their_logits_get_no_trees(temperature, field, value):
    params = Params()
    params.temperature = temperature
    assert tree_eligible(params)
    setattr(params, field, value)
    assert not tree_eligible(params) and not takes_argmax(params)
    assert not tree_eligible(None) and not takes_argmax(None)


def test_sampled_requests_get_trees_unless_they_use_min_p():
    """Temperature, top-k and top-p are drawn at every node by vLLM's sampler; min-p is
    applied by vLLM to the whole batch's rows, not a tree's nodes."""
    params = Params()
    assert takes_argmax(params) and tree_eligible(params)
    params.min_p = 0.1          # greedy: min-p keeps the argmax
    assert takes_argmax(params) and tree_eligible(params)
    params.temperature = 0.7
    assert not takes_argmax(params) and not tree_eligible(params)
    params.min_p = 0.0
    assert not takes_argmax(params) and tree_eligible(params)


def test_paged_kv_reads_what_vllm_cpu_writes():
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from vllm_retrieval_spec.verification.cpu import PagedKV, layout_checked_verifier

    kv_cache = torch.zeros(4, 3, 32, 2 * 64)
    verifier = layout_checked_verifier(kv_cache, 64, "auto")
    assert verifier is not None
    paged = verifier.paged
    slots = torch.tensor([3, 40, 41, 99], dtype=torch.int64)
    keys, values = torch.randn(4, 3, 64), torch.randn(4, 3, 64)
    paged.write(kv_cache, slots, keys, values)
    read_keys, read_values = paged.read(kv_cache, slots)
    assert torch.equal(read_keys, keys) and torch.equal(read_values, values)
    # Moved with slots that are a strided view (vLLM's writer reads a slot mapping as
    # contiguous): slot 3's entry to slot 7, slot 99's to slot 64, read before written.
    pairs = torch.tensor([[3, 7], [40, 41], [99, 64]], dtype=torch.int64)
    paged.mover(pairs[:, 0], pairs[:, 1], 32)(kv_cache)
    moved_keys, moved_values = paged.read(kv_cache, torch.tensor([7, 41, 64]))
    assert torch.equal(moved_keys, keys[[0, 1, 3]]) and torch.equal(moved_values,
                                                                     values[[0, 1, 3]])
    # A reader with the wrong layout is caught by the start-up check.
    wrong = PagedKV(paged.isa, 64)
    wrong.read = lambda cache, s: (paged.read(cache, s)[1], paged.read(cache, s)[0])
    assert not wrong.check(kv_cache)
    # So is a block reader that takes the keys' [head_size, block_size] for [block_size, ...].
    wrong = PagedKV(paged.isa, 64)
    wrong.blocks_of = lambda cache, context: (
        paged.blocks_of(cache, context)[0].transpose(2, 3).reshape(-1, 3, 64, 32),
        *paged.blocks_of(cache, context)[1:])
    assert paged.check(kv_cache) and not wrong.check(kv_cache)


def cpu_attention(**changes):
    """What the refusal reads of vLLM-CPU's ``CPUAttentionBackendImpl``, with its defaults."""
    from types import SimpleNamespace

    return SimpleNamespace(**{"sliding_window": -1, "logits_soft_cap": 0, "sinks": None,
                              "alibi_slopes": None, "kv_sharing_target_layer_name": None,
                              **changes})


def cpu_runner(layer, backend_name="CPU_ATTN", kv_transfer_config=None, rswa_window=None,
               **parallel):
    """What ``refuse_unsupported_trees`` reads of a vLLM-CPU runner with one layer;
    ``parallel``: changes to a single process's parallel config."""
    from types import SimpleNamespace

    backend = SimpleNamespace(get_name=lambda: backend_name)
    parallel_config = SimpleNamespace(**{"pipeline_parallel_size": 1,
                                         "decode_context_parallel_size": 1,
                                         "use_ubatching": False, **parallel})
    return SimpleNamespace(
        vllm_config=SimpleNamespace(kv_transfer_config=kv_transfer_config,
                                    parallel_config=parallel_config),
        model_config=SimpleNamespace(use_mla=False, uses_mrope=False, rswa_window=rswa_window),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        compilation_config=SimpleNamespace(static_forward_context={
            "model.layers.0.self_attn.attn": layer}),
        attn_groups=[[SimpleNamespace(backend=backend,
                                      layer_names=["model.layers.0.self_attn.attn"])]])


@pytest.mark.parametrize("changes, message", [
    ({"sliding_window": 4096}, "sliding-window attention"),
    ({"logits_soft_cap": 30.0}, "attention logit soft-capping"),
    ({"sinks": np.zeros(4)}, "attention sinks"),
    ({"alibi_slopes": np.ones(4)}, "ALiBi"),
    ({"kv_sharing_target_layer_name": "model.layers.3.self_attn.attn"},
     "a layer that shares another layer's KV cache"),
])
def test_vllm_cpu_attention_trees_cannot_reproduce_is_refused(changes, message):
    # The tree rows are attended again over the whole context with plain softmax attention:
    # with a sliding window, greedy outputs differed from plain decoding on vLLM-CPU.
    from vllm_retrieval_spec.config import ConfigError
    from vllm_retrieval_spec.verification.core import refuse_unsupported_trees
    from vllm_retrieval_spec.verification.cpu import tree_refusal

    from types import SimpleNamespace

    refuse_unsupported_trees(cpu_runner(SimpleNamespace(impl=cpu_attention())), tree_refusal)
    with pytest.raises(ConfigError, match=rf"{message} \(layer model.layers.0.self_attn.attn\); "
                                          r"set \"tree\": \"off\""):
        refuse_unsupported_trees(cpu_runner(SimpleNamespace(impl=cpu_attention(**changes))),
                                 tree_refusal)


def test_a_layer_that_is_not_attention_is_refused_by_its_backend():
    from types import SimpleNamespace

    from vllm_retrieval_spec.config import ConfigError
    from vllm_retrieval_spec.verification.core import refuse_unsupported_trees
    from vllm_retrieval_spec.verification.cpu import tree_refusal

    # A Mamba mixer: no attention implementation at all.
    with pytest.raises(ConfigError, match="attention backend MAMBA2_ATTN cannot attend tree rows"):
        refuse_unsupported_trees(cpu_runner(SimpleNamespace(), "MAMBA2_ATTN"), tree_refusal)


def test_layers_in_several_kv_cache_groups_are_refused():
    # Each group has a block table of its own; the accepted path is moved by one.
    from types import SimpleNamespace

    from vllm_retrieval_spec.config import ConfigError
    from vllm_retrieval_spec.verification.core import refuse_unsupported_trees
    from vllm_retrieval_spec.verification.cpu import tree_refusal

    runner = cpu_runner(SimpleNamespace(impl=cpu_attention()))
    refuse_unsupported_trees(runner, tree_refusal)
    runner.attn_groups = runner.attn_groups * 2
    with pytest.raises(ConfigError, match=r"with 2 KV-cache groups \(layers whose caches differ "
                                          r"in layout\); set \"tree\": \"off\""):
        refuse_unsupported_trees(runner, tree_refusal)


@pytest.mark.parametrize("layout, message", [
    # A connector saves the KV the forward wrote, before an off-chain path is moved.
    ({"kv_transfer_config": object()},
     r"with a KV connector \(kv_transfer_config\); set \"tree\": \"off\""),
    # Only the last stage has the drafter, and so a tree verifier: the earlier stages' layers
    # would attend tree nodes causally at sequential positions, and keep their KV unmoved.
    ({"pipeline_parallel_size": 2},
     r"pipeline parallelism \(pipeline_parallel_size 2\); set \"tree\": \"off\""),
    # Each rank's cache holds every n-th context token (vLLM's get_dcp_local_seq_lens): the
    # tree rows' context and the path's slots are not where this rank's cache has them.
    ({"decode_context_parallel_size": 2},
     r"decode context parallelism \(decode_context_parallel_size 2\)"),
    # A microbatched step (--enable-dbo) runs each layer's attention once per microbatch, with
    # metadata for part of the step: the tree rows were never attended, and the step failed.
    ({"use_ubatching": True}, r"microbatches \(--enable-dbo, ubatch_size\)"),
    # R-SWA layers have no sliding window of their own: the backend masks by the metadata's
    # window, and vLLM frees the context blocks between the prompt and the window.
    ({"rswa_window": 128},
     r"reference sliding-window attention \(rswa_window 128\); set \"tree\": \"off\""),
])
def test_engine_layouts_trees_cannot_be_verified_in_are_refused(layout, message):
    from types import SimpleNamespace

    from vllm_retrieval_spec.config import ConfigError
    from vllm_retrieval_spec.verification.core import refuse_unsupported_trees
    from vllm_retrieval_spec.verification.cpu import tree_refusal

    with pytest.raises(ConfigError, match=message):
        refuse_unsupported_trees(cpu_runner(SimpleNamespace(impl=cpu_attention()), **layout),
                                 tree_refusal)


def test_context_blocks_are_read_in_place_when_they_form_a_range():
    torch = pytest.importorskip("torch")
    from vllm_retrieval_spec.verification.cpu import ContextBlocks, PagedKV

    find = PagedKV.context_blocks
    # 70 tokens in blocks of 32: 2 whole blocks, then 6 tokens of the third.
    assert find(torch.tensor([5, 6, 7, 9], dtype=torch.int32), 70, 32) == \
        ContextBlocks(slice(5, 7), 7, 6)
    # In any order (blocks come back from finished requests reversed), and none partial.
    assert find(torch.tensor([6, 5, 2]), 64, 32) == ContextBlocks(slice(5, 7), 0, 0)
    scattered = find(torch.tensor([5, 7, 6, 8]), 70, 32)
    assert scattered.whole.tolist() == [5, 7] and (scattered.tail_block, scattered.tail_tokens) \
        == (6, 6)
    short = find(torch.tensor([3]), 5, 32)
    assert short.whole.numel() == 0 and (short.tail_block, short.tail_tokens) == (3, 5)

    paged = PagedKV("vec", 64)
    kv_cache = torch.randn(10, 3, 32, 2 * 64)
    # vLLM-CPU's cache: each (block, kv head) holds 32 keys' bytes, then 32 values.
    keys = kv_cache.view(10, 3, 64, 64)[:, :, :32].reshape(10, 3, 64, 32)
    values = kv_cache.view(10, 3, 64, 64)[:, :, 32:]
    key_blocks, value_blocks, key_tail, value_tail = paged.blocks_of(
        kv_cache, find(torch.tensor([5, 6, 7, 9]), 70, 32))
    assert torch.equal(key_blocks, keys[5:7]) and torch.equal(value_blocks, values[5:7])
    assert torch.equal(key_tail, keys[7, :, :, :6]) and torch.equal(value_tail, values[7, :, :6])
    # A range is read in place: views of the cache, no copy.
    assert all(t.untyped_storage().data_ptr() == kv_cache.untyped_storage().data_ptr()
               for t in (key_blocks, value_blocks, key_tail, value_tail))
    key_blocks, value_blocks, _, _ = paged.blocks_of(kv_cache, scattered)
    assert torch.equal(key_blocks, keys[[5, 7]]) and torch.equal(value_blocks, values[[5, 7]])


def test_begin_step_gives_tree_nodes_depth_positions_and_skips_what_is_not_the_tree():
    torch = pytest.importorskip("torch")
    from vllm_retrieval_spec.drafting.tree import TreeDraft
    from vllm_retrieval_spec.verification.core import TreeVerifier
    from vllm_retrieval_spec.verification.cpu import PagedKV

    tree = TreeDraft(TOKENS, PARENTS, 1, 0.5)
    verifier = TreeVerifier(PagedKV("vec", 64))
    # Rows: a (its tree, cut to 4 nodes by the scheduler), b (a prefill chunk), c (tokens that
    # are not its tree's: verified as the chain vLLM takes them for), d (a chain), e (a
    # request that may not get a tree: its tree is verified as a chain).
    scheduled = {"a": TOKENS[:4].tolist(), "c": [10, 11, 99], "d": [1, 2],
                 "e": TOKENS[:4].tolist()}
    num_scheduled = np.array([5, 7, 4, 3, 5])
    num_computed = np.array([20, 0, 30, 40, 50])
    positions = torch.arange(24) + 1000
    verifier.begin_step({"a": tree, "c": tree, "d": TreeDraft(np.array([1, 2]),
                                                              np.array([-1, 0]), 2, 0.0),
                         "e": tree},
                        ["a", "b", "c", "d", "e"], scheduled, num_scheduled, num_computed,
                        positions, 24, {"a": True, "c": False, "d": False})
    assert [(t.row, t.parents.tolist(), t.base, t.query_start, t.first_branch, t.sampled)
            for t in verifier.step.rows] == [(0, [-1, -1, 0, 0], 20, 0, 1, True)]
    # Only the rows after the leading chain are attended again: their mask rows.
    assert verifier.step.rows[0].mask.tolist() == [[False, True, False, False],
                                                   [True, False, True, False],
                                                   [True, False, False, True]]
    # Row a: root at 20, its nodes at depth 1, 1, 2, 2; every other row untouched.
    assert positions[:5].tolist() == [1000, 21, 21, 22, 22]
    assert positions[5:].tolist() == list(range(1005, 1024))
    assert verifier.stats() == {"tree_nodes_mean": (4 + 3 + 2 + 4) / 4, "tree_steps": 1}


@pytest.mark.parametrize("depth", range(2, 10))
def test_batched_walk_accepts_no_node_whose_first_ancestor_disagrees(depth):
    """Pointer jumping reaches every ancestor: in a chain whose nodes after the first all hold
    the target's token, nothing is accepted when the first does not (the greedy walk stops
    there)."""
    import torch

    parents = np.arange(depth) - 1
    tokens = np.arange(depth) + 10
    # After the root the target wants 99, not node 0's 10; after node j, node j + 1's token.
    targets = np.concatenate([[99], tokens[1:], [7]])
    assert greedy_tree_walk(parents, tokens, targets) == ([], 99)
    batch = (torch.from_numpy(a)[None] for a in (parents, tree_depths(parents), tokens, targets))
    assert batched_greedy_walk(*batch, depth).tolist() == [[-1], [99]]


def tree_step(*trees):
    """A ``TreeVerifier`` in the middle of a step with these ``TreeRow``s (attended, so its
    walk may run); its paged cache is never read."""
    from vllm_retrieval_spec.verification.core import TreeStep, TreeVerifier

    verifier = TreeVerifier(paged=None)
    verifier.step = TreeStep(list(trees), 0, kv_caches={0: "a layer's cache"})
    return verifier


def test_the_walk_checks_every_ancestor_in_the_deepest_tree_of_the_step():
    """The walk's rounds are as many as the deepest tree of the step needs, whichever row it
    is: request 0's nodes 1-4 hold the target's tokens but its node 0 does not, so it accepts
    nothing, and its last node is -1 (the root's hidden state gave the bonus)."""
    import torch

    from vllm_retrieval_spec.verification.core import TreeRow

    deep = TreeRow(0, np.array([-1, 0, 1, 2, 3, -1]), np.arange(6) + 100, 10, 0, 5)  # depth 5
    shallow = TreeRow(1, np.array([-1, -1, 1]), np.array([200, 201, 202]), 20, 7, 1)  # depth 2
    verifier = tree_step(deep, shallow)
    # The target's token after each request's root and each of its nodes.
    targets = [299, 101, 102, 103, 104, 0, 0] + [201, 0, 202, 7]
    logits = torch.zeros(len(targets), 300)
    logits[torch.arange(len(targets)), torch.tensor(targets)] = 1.0
    walks = verifier.walk(logits, [6, 3], torch.tensor([100, 101, 102, 103, 104, 105,
                                                        200, 201, 202]))
    assert [(tree.row, tokens, path) for tree, tokens, path in walks] == [
        (0, [299], []), (1, [201, 202, 7], [1, 2])]
    sampled = torch.full((2, 7), 5)
    verifier.accept(walks, sampled)
    assert sampled.tolist() == [[299] + [-1] * 6, [201, 202, 7] + [-1] * 4]
    assert verifier.last_nodes == {0: -1, 1: 2}
    # The next step has no trees: no row's last node is the last step's.
    verifier.begin_step({}, ["a", "b"], {}, np.array([1, 1]), np.array([11, 23]),
                        torch.arange(2), 2, {})
    assert verifier.step is None and verifier.last_nodes == {}


def test_attend_overwrites_only_the_layers_that_attend_the_whole_step():
    """A layer's attention whose metadata is not the step's (another token count: a
    microbatch, a dummy run) or that has none is left as the backend computed it."""
    from types import SimpleNamespace

    import torch

    attended = []
    verifier = tree_step()
    verifier.step.num_tokens, verifier.step.kv_caches = 9, {}
    verifier.paged = SimpleNamespace(attend=lambda step, *args: attended.append(args))
    impl, kv_cache, output = SimpleNamespace(scale=0.5), torch.zeros(2), torch.zeros(9)
    for metadata in (None, SimpleNamespace(num_actual_tokens=8, block_table="8's table")):
        verifier.attend(impl, "q", "k", "v", kv_cache, metadata, output)
    assert attended == [] and verifier.step.kv_caches == {}
    verifier.attend(impl, "q", "k", "v", kv_cache,
                    SimpleNamespace(num_actual_tokens=9, block_table="table"), output)
    assert attended == [("q", "k", "v", kv_cache, "table", output, 0.5)]
    assert verifier.step.kv_caches == {kv_cache.data_ptr(): kv_cache}
    assert verifier.step.block_table == "table"


def test_only_decoding_rows_count_as_verified_drafts():
    """A row scheduled with more tokens than its draft and the root (a chunk) verifies no
    draft this step: neither its tokens nor the step count in ``tree_nodes_mean``."""
    import torch

    from vllm_retrieval_spec.verification.core import TreeVerifier

    verifier = TreeVerifier(paged=None)
    verifier.begin_step({}, ["chunk", "decode"], {"chunk": [1, 2], "decode": [3]},
                        np.array([6, 2]), np.array([0, 10]), torch.arange(8), 8, {})
    assert verifier.stats() == {"tree_nodes_mean": 1.0, "tree_steps": 0}


class RecordingSampler:
    """A ``sample_nodes`` that records what it is asked and draws the tokens it is given."""

    def __init__(self, tokens):
        self.tokens, self.calls = tokens, []

    def __call__(self, logits, batch_rows):
        import torch

        self.calls.append((logits.argmax(dim=-1).tolist(), batch_rows.tolist()))
        return torch.tensor(self.tokens)


def test_a_sampled_trees_walk_follows_the_draws_at_its_root_and_nodes():
    """Row 0 takes the argmax; row 1 samples: the sampler gets its root's and nodes' logits
    rows (and their batch row, 1), and its walk follows the draws, not the argmax."""
    import torch

    from vllm_retrieval_spec.verification.core import TreeRow

    greedy = TreeRow(0, np.array([-1, -1]), np.array([100, 101]), 10, 0, 1)
    sampled = TreeRow(1, np.array([-1, -1, 1]), np.array([200, 201, 202]), 20, 3, 1,
                      sampled=True)
    verifier = tree_step(greedy, sampled)
    argmax = [101, 0, 0] + [200, 0, 0, 0]
    logits = torch.zeros(len(argmax), 300)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 1.0
    # The draws after row 1's root, node 0, node 1 (201: the root's second child), node 2.
    sample_nodes = RecordingSampler([201, 5, 202, 9])
    walks = verifier.walk(logits, [2, 3], torch.tensor([100, 101, 200, 201, 202]), sample_nodes)
    assert sample_nodes.calls == [([200, 0, 0, 0], [1, 1, 1, 1])]
    assert [(tree.row, tokens, path) for tree, tokens, path in walks] == [
        (0, [101, 0], [1]), (1, [201, 202, 9], [1, 2])]
    verifier = tree_step(greedy, sampled)
    with pytest.raises(RuntimeError, match="no node sampler"):
        verifier.walk(logits, [2, 3], torch.tensor([100, 101, 200, 201, 202]))


def test_walking_a_tree_along_draws_at_every_node_samples_the_targets_distribution():
    """The output of a step whose tree's nodes hold draws from the target is distributed as
    plain sampling's: here the first two tokens (the second drawn after the step where the
    walk ended at the first), over 200 000 steps, against p(t1) p(t2 | t1)."""
    import torch

    vocab, steps = 4, 200_000
    generator = torch.Generator().manual_seed(0)
    # The target's distribution after the root, after each first token, after each second.
    after_root = torch.tensor([0.5, 0.3, 0.15, 0.05])
    after_first = torch.softmax(torch.randn(vocab, vocab, generator=generator), dim=1)
    # Children of the root: tokens 1 and 0 (first the less likely); under node 1 (token 0),
    # token 2; under node 0 (token 1), token 3.
    parents = np.array([-1, -1, 1, 0])
    tokens = np.array([1, 0, 2, 3])
    node_first = [1, 0, 0, 1]   # each node's path's first token

    def draw(probs):
        return torch.multinomial(probs, 1, generator=generator)[:, 0]

    root_draws = draw(after_root.expand(steps, vocab))
    node_draws = torch.stack([draw(after_first[node_first[j]].expand(steps, vocab))
                              for j in range(len(parents))], dim=1)
    targets = torch.cat([root_draws[:, None], node_draws], dim=1)
    batch = [torch.from_numpy(a).expand(steps, -1) for a in (parents, tree_depths(parents),
                                                               tokens)]
    last, bonus = batched_greedy_walk(*batch, targets, 2)
    # The step's output: the accepted path's tokens, then the bonus (the draw at its end).
    node = last.clamp(min=0)
    depth = torch.where(last >= 0, torch.from_numpy(tree_depths(parents))[node], 0)
    first_node = torch.where(depth == 2, torch.from_numpy(parents)[node], node)
    node_tokens = torch.from_numpy(tokens)
    first = torch.where(depth > 0, node_tokens[first_node], bonus)
    # Where it accepted no node, the second token is the next step's draw.
    second = torch.where(depth == 2, node_tokens[node],
                         torch.where(depth == 1, bonus, draw(after_first[bonus])))
    joint = torch.bincount(first * vocab + second, minlength=vocab * vocab) / steps
    expected = (after_root[:, None] * after_first).flatten()
    assert (joint - expected).abs().sum() / 2 < 0.01     # a wrong distribution at the nodes: 0.4
    # The tree saved forwards: steps that accepted a node are those whose root draw was a
    # child's token (0 or 1).
    assert abs((last >= 0).float().mean() - 0.8) < 0.005



def _top_k_top_p_probs(logits, temperature, k, p):
    """The distribution vLLM samples from: temperature, then top-k, then top-p (tokens whose
    ascending cumulative probability is at most 1 - p go, the most likely one never)."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    order = np.argsort(x)
    ranked = x[order]
    if k is not None:
        ranked[:len(ranked) - k] = -np.inf
    if p is not None:
        cumulative = np.cumsum(np.exp(ranked - ranked.max()) / np.exp(ranked - ranked.max()).sum())
        cut = cumulative <= 1 - p
        cut[-1] = False
        ranked[cut] = -np.inf
    x[order] = ranked
    return np.exp(x - x.max()) / np.exp(x - x.max()).sum()


@pytest.mark.parametrize("top_k, top_p", [(None, None), ([2, 4], None), (None, [0.6, 1.0]),
                                          ([3, 4], [0.5, 0.9])])
def test_the_node_sampler_draws_from_each_requests_distribution_with_vllms_sampler(top_k,
                                                                                    top_p):
    """Rows of two requests with their own temperature, top-k and top-p, drawn by vLLM-CPU's
    top-k/top-p sampler: each request's rows follow its own distribution, and a request with
    a seed draws the same tokens again from a generator with that seed."""
    from types import SimpleNamespace

    import torch
    from vllm.platforms import current_platform
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    from vllm_retrieval_spec.verification.core import NodeSampler

    # vLLM-CPU's sampling op, from the library this CPU takes (as vLLM loads it): importing
    # vllm._C where an AVX-512 build was loaded already registers its ops twice, and aborts.
    current_platform.import_kernels()
    logits = torch.tensor([[1.0, 2.0, 0.5, 3.0], [0.0, 1.0, 2.0, 0.5]])
    temperature = [0.5, 2.0]
    rows = 40_000
    batch_rows = np.repeat([0, 1], rows // 2)

    def metadata(seed):
        return SimpleNamespace(temperature=torch.tensor(temperature),
                               top_k=None if top_k is None else torch.tensor(top_k),
                               top_p=None if top_p is None else torch.tensor(top_p),
                               generators={1: torch.Generator().manual_seed(seed)})

    sampler = TopKTopPSampler()
    tokens = NodeSampler(metadata(7), sampler)(logits[batch_rows], batch_rows)
    for r in (0, 1):
        drawn = np.bincount(tokens[batch_rows == r].numpy(), minlength=4) / (rows // 2)
        expected = _top_k_top_p_probs(logits[r].numpy(), temperature[r],
                                      None if top_k is None else top_k[r],
                                      None if top_p is None else top_p[r])
        assert np.abs(drawn - expected).max() < 0.015, (r, drawn, expected)
    again = NodeSampler(metadata(7), sampler)(logits[batch_rows], batch_rows)
    assert torch.equal(again[batch_rows == 1], tokens[batch_rows == 1])
