"""Every Triton kernel compiles for an H100 (sm_90) with the installed Triton, on this GPU-less
machine.

The other kernel tests run the kernels in Triton's interpreter, which executes them as numpy
code and so accepts what the compiler may refuse (a dot's operand types, a layout, more shared
memory than the card has). A GPU run is rare and short (a lent machine, minutes a session), so
what can fail there at compile time is found here: this file run as a script installs a driver
that only names the target (``cuda``, capability 90, warp 32), makes every launch compile
without running (outputs stay uninitialised; nothing reads them), and calls the kernels' public
launchers on CPU tensors at the shapes and options the GPU path uses: the three dtypes, split and
unsplit contexts and hidden dimensions, Llama-3-8B's and SmolLM2-135M's heads. Triton's own
ptxas turns each into a cubin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: The most shared memory one block of an H100 may use (227 KiB, opted in).
H100_MAX_SHARED = 232_448
#: (query heads, kv heads, head_dim): Llama-3-8B, SmolLM2-135M.
MODEL_HEADS = [(32, 8, 128), (9, 3, 64)]


def compile_everything() -> dict:
    """Compiles every launch, returns what each kernel compiled to."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class TargetOnlyDriver:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    driver.set_active(TargetOnlyDriver())
    compiled: dict[str, list[dict]] = {}
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.setdefault(f"{self.fn.__module__}.{self.fn.__name__}", []).append(
            {"asm": sorted(kernel.asm), "shared": kernel.metadata.shared,
             "arch": kernel.metadata.target.arch})
        return kernel

    JITFunction.run = compile_only

    sys.path.insert(0, str(Path(__file__).parent))
    from test_paged_tree_attention import chain, inputs, case, rest_like

    from vllm_retrieval_spec.kernels import paged_tree_attention, projection, tree_attention

    # CPU tensors would take the torch path for the masks: these launches are to be compiled.
    paged_tree_attention._use_triton = lambda t: True
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    parents = torch.tensor(rest_like(64))
    mask = tree_attention.tree_mask_triton(parents)
    for dtype in dtypes:
        for heads, kv_heads, head_dim in MODEL_HEADS:
            for splits in (1, 3):
                q = torch.zeros(64, heads, head_dim, dtype=dtype)
                k_ctx = torch.zeros(700, kv_heads, head_dim, dtype=dtype)
                k_tree = torch.zeros(64, kv_heads, head_dim, dtype=dtype)
                tree_attention.tree_attention_masked_triton(q, k_ctx, k_ctx, k_tree, k_tree,
                                                            mask, head_dim ** -0.5, splits)
                c = case([(rest_like(64), 600, 0), (chain(16), 2048, 3)], heads=heads,
                         kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, splits=splits)
                paged_tree_attention.paged_tree_attention(*inputs(c), head_dim ** -0.5,
                                                          splits=splits)
                # The GPU check's launch choices (rows per program) besides the default.
                for block_m in (16, 32) if dtype == torch.bfloat16 else ():
                    paged_tree_attention.paged_tree_attention(
                        *inputs(c), head_dim ** -0.5, splits=splits, block_m=block_m)
        # PCA dims up to the hidden size are accepted: 300 and 1000 fit in shared memory only
        # tiled across programs, 256 only in 16-row blocks (130 rows would take 64-row blocks
        # on one "multiprocessor").
        for rows, hidden, dims in [(1, 4096, 64), (64, 576, 48), (1, 4096, 300),
                                   (3, 1000, 1000), (130, 576, 256)]:
            for splits in (1, 4):
                projection.project_triton(torch.zeros(rows, hidden, dtype=dtype),
                                          torch.zeros(hidden), torch.ones(hidden),
                                          torch.zeros(hidden, dims), splits)
    defined = [f"{f.fn.__module__}.{f.fn.__name__}"
               for module in (tree_attention, paged_tree_attention, projection)
               for f in module._kernels()]
    return {"defined": defined, "compiled": compiled}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    pytest.importorskip("triton")
    path = tmp_path_factory.mktemp("kernel-compile") / "compiled.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, __file__, str(path)], capture_output=True, text=True,
                         env=env, timeout=1200)
    if run.returncode != 0:
        pytest.fail(f"compiling the kernels for sm_90 failed:\n{run.stderr[-6000:]}")
    return json.loads(path.read_text())


def test_every_kernel_is_compiled(compiled):
    assert len(compiled["defined"]) == 8
    assert sorted(compiled["compiled"]) == sorted(set(compiled["defined"]))


def test_every_launch_is_a_hopper_cubin_within_its_shared_memory(compiled):
    launches = [launch for kernel in compiled["compiled"].values() for launch in kernel]
    assert len(launches) > 50
    for launch in launches:
        assert "cubin" in launch["asm"] and launch["arch"] == 90
        assert 0 <= launch["shared"] <= H100_MAX_SHARED


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(json.dumps(compile_everything()))
