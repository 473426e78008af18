"""Lab tools, outside the wheel: replay, sweeps, kernel timing and other measurements.

They import the product from ``vllm_retrieval_spec`` and run from the repository root as
``python -m benchmarks.<tool>``; what ``vllm-rsd`` runs lives in ``vllm_retrieval_spec.bench``.
"""
