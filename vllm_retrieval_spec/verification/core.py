"""Token-tree drafts verified inside vLLM 0.32, which itself verifies only chains: the part
every attention backend shares (depths, walk, KV moves); ``verification.cpu`` is vLLM-CPU's
attention.

A drafter that drafts a tree for a request returns its nodes, in topological order, as that
request's draft tokens and keeps the tree (``contract.Drafter.trees``). vLLM
schedules them like a chain: one KV slot each, at the sequential positions after the root (the
request's last sampled token). ``plugin.py`` wires the four changes a tree needs into one step:

1. ``begin_step`` (after vLLM prepared the inputs): each node's rotary position becomes the
   root's position plus its depth. The KV slots stay sequential, so siblings never collide.
2. ``attend`` (after the CPU attention kernel): the kernel attended causally, so a node saw
   every earlier node. That is right for the leading chain (the drafter's chain comes first,
   each node the previous one's child: its earlier nodes are its ancestors); the rows after it
   are attended again, to the context and to their own ancestors only, and overwrite the
   kernel's rows. The root's row is causal and stays.
3. ``accept`` (after vLLM's rejection sampler): the target's token at the root and at every
   node (its argmax, or a sample: below) gives the longest root path whose tokens the target
   produced itself, plus the bonus token. It replaces the request's row of sampled tokens, so
   vLLM's scheduler counts ``len(path)`` accepted and the rest rejected, exactly as for a chain
   of that length.
4. Still in ``accept``: the path's KV entries are copied to the slots right after the root,
   where plain decoding would have written them; the rejected nodes' slots are the
   "rejected tail" vLLM overwrites next step.

Which requests get trees (``tree_eligible``): greedy ones without anything that changes the
argmax, where acceptance of drafts that carry no probabilities is exactly "the target's
argmax"; and sampled ones shaped by temperature, top-k and top-p alone, where a token is drawn
from the target's distribution at the root and at every node (``NodeSampler``, vLLM's own
sampler) and the walk follows the draws: every token of the output is one draw from the
target's distribution after the tokens before it, as in plain sampling, and the tree only
decides how many draws one forward yields. Every other request keeps vLLM's own chain
verification and rejection sampling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


#: vLLM's marker for "no token" in a row of sampled tokens.
PLACEHOLDER_TOKEN_ID = -1


def tree_depths(parents: np.ndarray) -> np.ndarray:
    """Depth of every node; a child of the root has depth 1. ``parents[i]`` in [-1, i)."""
    depths = np.empty(len(parents), dtype=np.int64)
    for i, parent in enumerate(parents):
        depths[i] = 1 if parent < 0 else depths[parent] + 1
    return depths


def is_chain(parents: np.ndarray) -> bool:
    return leading_chain_len(parents) == len(parents)


def leading_chain_len(parents: np.ndarray) -> int:
    """How many first nodes form a chain from the root (``parents[i] == i - 1``): causal
    attention is already ancestor-only for them."""
    off_chain = np.flatnonzero(parents != np.arange(len(parents)) - 1)
    return int(off_chain[0]) if len(off_chain) else len(parents)


def valid_tree(parents: np.ndarray) -> bool:
    """Topological order: every parent precedes its children (or is the root, -1)."""
    return bool(np.all((parents >= -1) & (parents < np.arange(len(parents)))))


def greedy_tree_walk(parents: np.ndarray, tokens: np.ndarray,
                     target: np.ndarray) -> tuple[list[int], int]:
    """The accepted root path and the bonus token.

    ``target[0]`` is the target model's token after the root, ``target[j + 1]`` the one after
    node ``j``. From the root, the walk moves to the child whose token is the target's token
    there, and stops where no child has it: that token is the bonus.

    Returns ``(path, bonus)``, ``path`` being node indices (increasing, a root path).
    """
    path: list[int] = []
    node = -1
    while True:
        wanted = int(target[node + 1])
        children = np.flatnonzero((parents == node) & (tokens == wanted))
        if len(children) == 0:
            return path, wanted
        # Siblings with equal tokens are the drafter's mistake; the first one is as good.
        node = int(children[0])
        path.append(node)


def batched_greedy_walk(parents: Any, depths: Any, tokens: Any, targets: Any,
                        max_depth: int) -> Any:
    """:func:`greedy_tree_walk` for a batch of trees at once, in tensor operations on their
    device: no loop over nodes or trees, so a GPU step needs no host round trip per tree.

    ``parents``, ``depths``, ``tokens``: int64 ``[B, N]``, each tree's nodes padded to N (padding
    has depth 0); ``targets``: ``[B, N + 1]``, the target's token after the root, then after each
    node; ``max_depth``: the deepest node's depth, known on the host.

    A node is accepted when it and all its ancestors hold the target's token after their parent
    (pointer jumping: ``log2`` of the depth rounds); the deepest accepted node ends the path (a
    trie's siblings differ, so at most one path agrees). Returns int64 ``[2, B]``: each tree's
    last accepted node (-1: none) and its bonus token (the target's after that node)."""
    import torch

    agrees = (tokens == targets.gather(1, parents + 1)) & (depths > 0)
    accepted, jump = agrees, parents
    for _ in range(max_depth.bit_length()):
        has_parent = jump >= 0
        up = jump.clamp(min=0)
        accepted = accepted & (accepted.gather(1, up) | ~has_parent)
        jump = torch.where(has_parent, jump.gather(1, up), jump)
    deepest, node = torch.where(accepted, depths, 0).max(dim=1)
    node = torch.where(deepest > 0, node, -1)
    return torch.stack([node, targets.gather(1, (node + 1)[:, None])[:, 0]])


def root_path(parents: np.ndarray, node: int) -> list[int]:
    """The nodes from the root's child down to ``node`` (none for -1)."""
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return path[::-1]


def path_moves(path: list[int]) -> list[tuple[int, int]]:
    """(from, to) offsets after the root of the KV entries to copy: the k-th path node (node
    ``path[k]``, at offset ``path[k] + 1``) belongs at offset ``k + 1`` (``path[k] >= k``)."""
    return [(node + 1, k + 1) for k, node in enumerate(path) if node != k]


def attention_refusal(impl: Any, use_mla: bool, uses_mrope: bool) -> str | None:
    """Why no backend's tree rows can be attended again for this attention layer, or None: the
    rows are recomputed over the whole context with plain softmax attention, at depth positions
    in ``positions``. ``impl`` is the layer's attention implementation (its ``attn_type``,
    ``sliding_window``, ``logits_soft_cap``, ``sinks``, ``alibi_slopes``,
    ``kv_sharing_target_layer_name``)."""
    if use_mla:
        return ("multi-head latent attention (MLA) keeps a compressed cache tree attention "
                "cannot read")
    if uses_mrope:
        return ("M-RoPE positions are 3-D; a tree node's position is its depth, which they "
                "cannot express")
    attn_type = getattr(impl, "attn_type", "decoder")
    if attn_type != "decoder":
        # Cross-attention (encoder-decoder models) or encoder attention attends no earlier
        # decoder tokens: recomputing its tree rows over its cache, and moving its entries,
        # would overwrite what it computed and the encoder's keys and values.
        return f"{getattr(attn_type, 'value', attn_type)} attention (an encoder's)"
    # No window: None, -1 (vLLM-CPU) or (-1, -1) (FLASH_ATTN, TRITON_ATTN).
    if getattr(impl, "sliding_window", None) not in (None, -1, (-1, -1)):
        return "sliding-window attention"
    if getattr(impl, "logits_soft_cap", None):
        return "attention logit soft-capping"
    if getattr(impl, "sinks", None) is not None:
        return "attention sinks"
    if getattr(impl, "alibi_slopes", None) is not None:
        return "ALiBi"
    if getattr(impl, "kv_sharing_target_layer_name", None) is not None:
        # Such a layer gets no key and value of its own to attend the tree rows with.
        return "a layer that shares another layer's KV cache"
    return None


def layout_refusal(vllm_config: Any, model_config: Any) -> str | None:
    """Why trees cannot be verified with this engine's layout of a step, or None: the verifier
    needs one forward of every layer over the whole step, in this process's cache."""
    if vllm_config.kv_transfer_config is not None:
        # A connector saves a step's KV as the forward wrote it: for an accepted path off the
        # chain, before its entries are moved to their positions.
        return "with a KV connector (kv_transfer_config)"
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        # vLLM gives only the last stage the drafter, and so a tree verifier: the earlier
        # stages' layers would attend tree nodes causally at sequential positions.
        return (f"with pipeline parallelism (pipeline_parallel_size "
                f"{parallel.pipeline_parallel_size})")
    if parallel.decode_context_parallel_size > 1:
        # Each rank's cache holds every n-th context token: the tree rows' context and the
        # accepted path's slots are not where this rank's cache has them.
        return (f"with decode context parallelism (decode_context_parallel_size "
                f"{parallel.decode_context_parallel_size})")
    if parallel.use_ubatching:
        # A microbatched step runs each layer's attention once per microbatch, with metadata
        # for part of the step: ``TreeVerifier.attend`` finds no tree rows there.
        return "in microbatches (--enable-dbo, ubatch_size)"
    if model_config.rswa_window is not None:
        # Its layers have no window of their own: the backend masks by the metadata's, and
        # vLLM frees the context blocks between the prompt and the window.
        return (f"with reference sliding-window attention (rswa_window "
                f"{model_config.rswa_window})")
    return None


def attention_variant(layer: Any) -> str | None:
    """The class name of ``layer`` where it is a variant of vLLM's ``Attention`` (chunked-local,
    static sinks, cross, encoder-only...), else None. A variant's backend keeps the plain one's
    name and implementation, but its metadata is its own: chunked-local layers read block
    tables of virtual batches (a row per request and chunk), sink layers a table whose sink
    blocks come first; the tree kernel would read another request's or another position's KV."""
    from vllm.model_executor.layers.attention.attention import Attention

    kind = type(layer)
    return kind.__name__ if isinstance(layer, Attention) and kind is not Attention else None


def refuse_unsupported_trees(runner: Any,
                             tree_refusal: Callable[[str, Any, str, bool, bool], str | None]
                             ) -> None:
    """Raise ``ConfigError`` where ``runner``'s engine lays a step out otherwise than the
    verifier needs (``layout_refusal``), or naming the first attention layer for which
    ``tree_refusal(backend name, impl, KV cache dtype, use_mla, uses_mrope)`` (the platform's)
    gives a reason; with the fix (``tree: off`` always is one)."""
    from vllm_retrieval_spec.config import ConfigError

    fix = "set \"tree\": \"off\" in the speculative config"
    model_config = runner.model_config
    reason = layout_refusal(runner.vllm_config, model_config)
    if reason is not None:
        raise ConfigError(f"tree drafts cannot be verified {reason}; {fix}")
    layers = runner.compilation_config.static_forward_context
    for group in (g for groups in runner.attn_groups for g in groups):
        for name in group.layer_names:
            variant = attention_variant(layers[name])
            if variant is not None:
                raise ConfigError(f"tree drafts cannot be verified with {variant} layers (layer "
                                  f"{name}): the kernel attends as vLLM's plain Attention "
                                  f"does; {fix}")
            # A layer of another kind (a Mamba mixer) has no attention implementation; its
            # backend is refused.
            reason = tree_refusal(group.backend.get_name(), getattr(layers[name], "impl", None),
                                  runner.cache_config.cache_dtype, model_config.use_mla,
                                  model_config.uses_mrope)
            if reason is not None:
                raise ConfigError(f"tree drafts cannot be verified here: {reason} (layer "
                                  f"{name}); {fix}")
    if len(runner.attn_groups) > 1:
        # One list per KV-cache group, each with a block table of its own: the accepted path
        # is moved by one table, for every layer.
        raise ConfigError(f"tree drafts cannot be verified with {len(runner.attn_groups)} "
                          f"KV-cache groups (layers whose caches differ in layout); {fix}")


#: Below this temperature vLLM takes the argmax (its sampler's ``_SAMPLING_EPS``).
GREEDY_TEMPERATURE = 1e-5


def _plain_logits(p: Any) -> bool:
    """Nothing (penalties, biases, masks, grammars, logprobs) applied to the logits before
    temperature, top-k and top-p."""
    return (p.logprobs is None and p.presence_penalty == 0 and p.frequency_penalty == 0
            and p.repetition_penalty == 1.0 and p.min_tokens == 0 and not p.logit_bias
            and not p.allowed_token_ids and not p.bad_words and p.structured_outputs is None
            and p.thinking_token_budget is None)


def takes_argmax(sampling_params: Any) -> bool:
    """Whether a request's output is the target's plain argmax at every position: greedy, and
    nothing applied to the logits first."""
    p = sampling_params
    return p is not None and p.temperature < GREEDY_TEMPERATURE and _plain_logits(p)


def tree_eligible(sampling_params: Any) -> bool:
    """Whether a request's drafts may be verified as trees: it takes the argmax, or it samples
    from the target's distribution shaped by temperature, top-k and top-p alone (no min-p:
    vLLM's sampler applies that to the whole batch, not to a tree's nodes)."""
    p = sampling_params
    return p is not None and _plain_logits(p) and (
        p.temperature < GREEDY_TEMPERATURE or p.min_p == 0)


class NodeSampler:
    """The target's token at the root and nodes of sampled requests' trees, drawn as vLLM
    draws a chain's: the logits in float32 over the request's temperature, then its top-k and
    top-p, and a token drawn by the runner's own top-k/top-p sampler, with the request's
    generator where it has a seed (draws at nodes off the accepted path are thrown away)."""

    def __init__(self, sampling_metadata: Any, topk_topp_sampler: Callable) -> None:
        #: vLLM's ``SamplingMetadata`` of the step: per batch row ``temperature``, ``top_k``
        #: and ``top_p`` (None where no request uses them), ``generators``.
        self.metadata = sampling_metadata
        self.topk_topp_sampler = topk_topp_sampler

    def __call__(self, logits: Any, batch_rows: np.ndarray) -> Any:
        """One token per row of ``logits``; ``batch_rows``: each row's request."""
        import torch

        m = self.metadata
        rows = torch.from_numpy(batch_rows).to(logits.device)
        scaled = logits.to(torch.float32) / m.temperature[rows].unsqueeze(1)
        generators = {i: m.generators[r] for i, r in enumerate(batch_rows.tolist())
                      if r in m.generators}
        tokens, _ = self.topk_topp_sampler(scaled, generators,
                                           None if m.top_k is None else m.top_k[rows],
                                           None if m.top_p is None else m.top_p[rows])
        return tokens


@dataclass
class TreeRow:
    """One request's tree in this step."""
    row: int                 # batch row
    parents: np.ndarray      # int64 [n]
    tokens: np.ndarray       # the nodes' draft tokens [n]
    base: int                # position (and slot offset) of the root
    query_start: int         # the root's row in this step's flattened tokens
    #: Nodes before this one are the leading chain; only the later rows are attended again.
    first_branch: int
    #: The request samples (``NodeSampler`` draws the target's tokens), not the argmax.
    sampled: bool = False
    #: vLLM-CPU's: tree_ancestor_mask(parents)'s rows from ``first_branch`` on, for every layer
    #: of the step.
    mask: Any = None
    #: vLLM-CPU's: the cache blocks of the context (the root included, as its ``PagedKV`` finds
    #: them) at the step's first layer: every layer's cache shares the block table.
    context: Any = None


@dataclass
class TreeStep:
    """What one step's tree rows need from ``begin_step`` to ``accept``."""
    rows: list[TreeRow]
    num_tokens: int
    #: Each attention layer's KV cache, seen by ``attend``; ``accept`` moves the path there.
    kv_caches: dict[int, Any] = field(default_factory=dict)
    block_table: Any = None
    #: What the backend's attention prepared once for the step's every layer (``prepare``).
    attention: Any = None


class TreeVerifier:
    """The four steps above for one model runner (see the module docstring)."""

    def __init__(self, paged: Any) -> None:
        #: The attention backend's paged KV cache (``verification.cpu.PagedKV``,
        #: ``verification.cuda.CudaPagedKV``): prepares a step's trees, attends their rows over
        #: the cache, and copies its entries from slot to slot (``mover``).
        self.paged = paged
        self.step: TreeStep | None = None
        #: Batch row -> index of the last accepted node (-1: none) of the last step's trees:
        #: the row of the hidden state that produced the bonus token.
        self.last_nodes: dict[int, int] = {}
        #: Draft nodes verified, decoding steps of requests and, of those, steps that verified a
        #: tree, since start or ``stats(reset)``.
        self.nodes = self.decode_steps = self.tree_steps = 0

    def stats(self, reset: bool = False) -> dict[str, float]:
        """``tree_nodes_mean``: draft nodes (tree or chain) verified per request per step."""
        stats = {"tree_nodes_mean": self.nodes / self.decode_steps if self.decode_steps else 0.0,
                 "tree_steps": self.tree_steps}
        if reset:
            self.nodes = self.decode_steps = self.tree_steps = 0
        return stats

    def begin_step(self, drafter_trees: dict[str, Any], req_ids: list[str],
                   scheduled_drafts: dict[str, list[int]], num_scheduled: np.ndarray,
                   num_computed: np.ndarray, positions: Any, num_tokens: int,
                   samples: dict[str, bool]) -> None:
        """Find this step's tree rows and give their nodes depth positions. ``samples``: for
        each request of ``drafter_trees`` that is ``tree_eligible``, whether it samples (False:
        it takes the argmax); the trees of the others are verified as chains."""
        self.step = None
        self.last_nodes = {}
        rows = []
        query_start = 0
        for i, req_id in enumerate(req_ids):
            draft = scheduled_drafts.get(req_id, ())
            n = len(draft)
            decoding = int(num_scheduled[i] == n + 1)
            self.nodes += n * decoding
            self.decode_steps += decoding
            tree = drafter_trees.get(req_id)
            # The scheduler may cut a draft short; any prefix of a topological order is a tree.
            # Tokens that are not the tree's (a draft from another step) are verified as the
            # chain vLLM takes them for: any token sequence verifies losslessly as a chain.
            if tree is not None and n and decoding and req_id in samples:
                parents = np.asarray(tree.parents[:n], dtype=np.int64)
                first_branch = leading_chain_len(parents)
                if first_branch < n and np.array_equal(tree.tokens[:n], draft):
                    rows.append(TreeRow(i, parents, np.asarray(draft), int(num_computed[i]),
                                        query_start, first_branch, samples[req_id]))
            query_start += int(num_scheduled[i])
        if not rows:
            return
        self.tree_steps += len(rows)
        import torch

        # One copy for every tree's positions (a GPU runner's positions are on the device).
        rows_at = np.concatenate([tree.query_start + 1 + np.arange(len(tree.parents))
                                  for tree in rows])
        depths = np.concatenate([tree.base + tree_depths(tree.parents) for tree in rows])
        positions[torch.from_numpy(rows_at).to(positions.device)] = torch.from_numpy(
            depths).to(positions.device, positions.dtype)
        self.step = TreeStep(rows, num_tokens, attention=self.paged.prepare(rows))

    def attend(self, impl: Any, query: Any, key: Any, value: Any, kv_cache: Any,
               attn_metadata: Any, output: Any) -> None:
        """Overwrite the tree rows of one layer's attention output."""
        step = self.step
        if step is None or attn_metadata is None or \
                attn_metadata.num_actual_tokens != step.num_tokens:
            return
        step.kv_caches[kv_cache.data_ptr()] = kv_cache
        step.block_table = attn_metadata.block_table
        self.paged.attend(step, query, key, value, kv_cache, attn_metadata.block_table, output,
                          impl.scale)

    def walk(self, logits: Any, num_draft_tokens: list[int], draft_token_ids: Any,
             sample_nodes: Callable[[Any, np.ndarray], Any] | None = None,
             ) -> list[tuple[TreeRow, list[int], list[int]]]:
        """Each tree row's sampled tokens (accepted path, then the bonus token) and path (node
        indices), from the target's argmax, or for a ``sampled`` row from ``sample_nodes``
        (a ``NodeSampler``: the logits rows of its root and nodes, and their batch rows).

        ``logits`` has ``num_draft_tokens[i] + 1`` rows per request, in batch order (vLLM's
        logits for a speculative step); ``draft_token_ids`` is every request's draft,
        concatenated. Read before vLLM's sampler runs, which may modify ``logits`` in place."""
        if self.step is None:
            return []
        if not self.step.kv_caches:
            # Its logits came from causal attention over siblings: accepting by them could
            # change the output. A full CUDA graph replay skips the attention wrapper;
            # ``patches.engine_args`` keeps graphs piecewise while trees are on.
            raise RuntimeError("a step with token trees ran no tree attention (was a full CUDA "
                               "graph replayed?); its outputs cannot be verified")
        import torch

        rows = self.step.rows
        drafted = np.asarray(num_draft_tokens)
        logit_starts = np.concatenate([[0], np.cumsum(drafted + 1)])
        draft_starts = np.concatenate([[0], np.cumsum(drafted)])
        nodes = max(len(tree.parents) for tree in rows)
        # Built on the host, one copy to the device: every tree's logits rows (``flat``), then
        # per tree its nodes' parents, depths, targets (as rows of ``flat``) and draft tokens
        # (as rows of ``draft_token_ids``), padded to the largest tree.
        flat = np.concatenate([logit_starts[t.row] + np.arange(len(t.parents) + 1)
                               for t in rows])
        index = np.zeros((len(rows), 4, nodes + 1), dtype=np.int64)
        offset = max_depth = 0
        for b, tree in enumerate(rows):
            n = len(tree.parents)
            depths = tree_depths(tree.parents)
            max_depth = max(max_depth, int(depths.max()))
            index[b, 0, :n], index[b, 1, :n] = tree.parents, depths
            index[b, 2] = offset + np.minimum(np.arange(nodes + 1), n)
            index[b, 3] = draft_starts[tree.row] + np.minimum(np.arange(nodes + 1), n - 1)
            offset += n + 1
        # Then the rows of ``flat`` that are sampled trees' roots and nodes.
        sampled = [b for b, tree in enumerate(rows) if tree.sampled]
        if sampled and sample_nodes is None:
            raise RuntimeError("a step with trees of sampled requests has no node sampler")
        sampled_at = np.concatenate([index[b, 2, :len(rows[b].parents) + 1] for b in sampled]
                                    + [index[:0, 0, 0]])
        device = torch.from_numpy(np.concatenate([flat, index.ravel(), sampled_at])).to(
            logits.device)
        step_logits = logits[device[:len(flat)]]
        targets = step_logits.argmax(dim=-1)
        if sampled:
            at = device[len(flat) + index.size:]
            batch_rows = np.concatenate([np.full(len(rows[b].parents) + 1, rows[b].row)
                                         for b in sampled])
            targets[at] = sample_nodes(step_logits[at], batch_rows).to(targets.dtype)
        index = device[len(flat):len(flat) + index.size].view(index.shape)
        targets = targets[index[:, 2]]
        tokens = draft_token_ids.to(logits.device)[index[:, 3, :nodes]].to(targets.dtype)
        # The walk on the logits' device, and one copy to the host for every tree.
        last, bonus = batched_greedy_walk(index[:, 0, :nodes], index[:, 1, :nodes], tokens,
                                          targets, max_depth).cpu().numpy()
        walks = []
        for tree, node, token in zip(rows, last.tolist(), bonus.tolist()):
            path = root_path(tree.parents, node)
            walks.append((tree, [int(tree.tokens[j]) for j in path] + [token], path))
        return walks

    def accept(self, walks: list[tuple[TreeRow, list[int], list[int]]], sampled: Any) -> None:
        """Replace the tree rows of vLLM's sampled tokens (``[num_reqs, max_spec_len + 1]``)
        with their accepted path and bonus token, and move the paths' KV entries into place:
        every tree's at once: one copy to the device and one move a layer, however many trees
        the step has."""
        step, self.step = self.step, None
        if step is None or not walks:
            return
        import torch

        # Each tree's batch row, then its row of sampled tokens.
        rows = np.full((len(walks), 1 + sampled.shape[1]), PLACEHOLDER_TOKEN_ID, dtype=np.int64)
        moves = []
        for b, (tree, tokens, path) in enumerate(walks):
            rows[b, 0] = tree.row
            rows[b, 1:1 + len(tokens)] = tokens
            moves += [(tree.row, tree.base + source, tree.base + target)
                      for source, target in path_moves(path)]
            self.last_nodes[tree.row] = path[-1] if path else -1
        # The moves ride in the rows' copy: each copy from pageable memory holds the host.
        moves = np.asarray(moves, dtype=np.int64).reshape(-1, 3)
        packed = torch.from_numpy(np.concatenate([rows.ravel(), moves.ravel()]))
        rows_on_device, moves_on_device = packed.to(sampled.device).split([rows.size, moves.size])
        rows_on_device = rows_on_device.view(rows.shape)
        sampled[rows_on_device[:, 0]] = rows_on_device[:, 1:].to(sampled.dtype)
        self._move(step, moves_on_device.view(moves.shape))

    def _move(self, step: TreeStep, moves: Any) -> None:
        """Copy the KV entry of each (batch row, source position, target position), an int64
        ``[n, 3]`` tensor on the cache's device, in every layer's cache. Trees' entries lie in
        their own requests' blocks, and a layer's are all read before any is written
        (``path_moves``' order needs no more)."""
        if not len(moves) or step.block_table is None:
            return
        table = step.block_table
        # Every layer's cache shares the block table and block size: the slots are found once.
        block_size = next(iter(step.kv_caches.values())).shape[2]
        rows, positions = moves.split([1, 2], dim=1)
        slots = table[rows, positions // block_size].to(moves.dtype) * block_size \
            + positions % block_size
        source, target = slots.unbind(1)
        move = self.paged.mover(source, target, block_size)
        for kv_cache in step.kv_caches.values():
            move(kv_cache)
