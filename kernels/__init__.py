"""Triton kernels with torch references (installed as ``vllm_retrieval_spec.kernels``).

The fused z-norm/PCA/L2 projection arrives with DReSD and the tree-attention mask with tree
verification; REST drafts chains and needs no kernel.
"""
