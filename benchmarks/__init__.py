"""Throughput and acceptance benchmarks (installed as ``vllm_retrieval_spec.benchmarks``)."""
