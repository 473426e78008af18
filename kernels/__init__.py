"""Triton kernels with torch references (installed as ``vllm_retrieval_spec.kernels``).

- ``projection``: DReSD's fused z-norm/PCA/L2 query projection;
- ``tree_attention``: the ancestor mask of a token tree and attention of its nodes;
- ``launch``: what their launchers ask of the platform.

GPU timings: ``benchmarks/kernel_timing.py`` and ``benchmarks/kernel_sweep.py``.
"""
