#!/usr/bin/env bash
# Issue-7 GPU check in one command, for a bare CUDA machine without a package registry
# (needs python3 with torch (CUDA build), nvcc, ninja; pytest optional): builds
# dspark_serve._C for this GPU's architecture, runs the GPU tests, then the kernel benchmark
# (correctness on poisoned outputs, timings vs the torch reference, FlashInfer and the
# memory-bandwidth floor). Expected: ~5-7 minutes on an H100/H200 (csrc/README.md).
#
#   scripts/gpu_check.sh              full run
#   scripts/gpu_check.sh --quick      small benchmark (smoke test)
#   scripts/gpu_check.sh --dry-run    check inputs and print the plan; builds and runs nothing
#
# With OUT set, writes $OUT/kernel_bench.json and $OUT/gpu_check.log. Exit 0 only if the
# build, the tests and every benchmark check pass.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
dry=0
bench_args=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry=1 ;;
    --quick) bench_args+=(--quick) ;;
    *) echo "usage: $0 [--dry-run] [--quick]" >&2; exit 2 ;;
  esac
done
if [[ -n "${OUT:-}" && $dry -eq 0 ]]; then
  mkdir -p "$OUT" && exec > >(tee "$OUT/gpu_check.log") 2>&1
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ -z "${CUDA_HOME:-}" && -x /usr/local/cuda/bin/nvcc ]]; then
  export CUDA_HOME=/usr/local/cuda  # torch guesses wrong for an nvcc wrapper in /usr/local/bin
fi

echo "== inputs"
"$PY" -m dspark_serve.bench.kernels --dry-run "${bench_args[@]}" || exit 2
if [[ $dry -eq 1 ]]; then
  echo "== plan: DSPARK_BUILD_CUDA=1 DSPARK_CUDA_ARCHS=<this GPU> $PY setup.py build_ext --inplace;"
  echo "   GPU tests (pytest tests/gpu, or unittest without pytest); $PY -m dspark_serve.bench.kernels"
  for tool in nvcc ninja; do
    command -v "$tool" >/dev/null || [[ -x "${CUDA_HOME:-/nonexistent}/bin/$tool" ]] \
      || echo "warning: $tool not found (needed for the build)"
  done
  exit 0
fi

arch=$("$PY" -c "import torch; major, minor = torch.cuda.get_device_capability(); print(f'{major}{minor}')") \
  || { echo "error: no CUDA device visible to torch" >&2; exit 2; }
echo "== build dspark_serve._C for sm_$arch"
start=$SECONDS
DSPARK_BUILD_CUDA=1 DSPARK_CUDA_ARCHS="$arch" "$PY" setup.py -q build_ext --inplace \
  || { echo "error: the CUDA extension did not build" >&2; exit 1; }
echo "built in $((SECONDS - start)) s"

status=0
echo "== GPU tests"
if "$PY" -c "import pytest" 2>/dev/null; then
  "$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu || status=1
else
  "$PY" -m unittest discover -s tests/gpu -t tests/gpu -v || status=1
fi

echo "== benchmark"
"$PY" -m dspark_serve.bench.kernels "${bench_args[@]}" || status=1
echo "== SGLang plugin smoke (DSPARK_SERVE vs no speculation, greedy)"
# Only where sglang is importable; bounded: 600 s per server start, 120 s per request.
# Needs a drafter for the model (shipped or DSPARK_DRAFT) and a cost table (DSPARK_COST_TABLE).
if "$PY" -c "import sglang" 2>/dev/null; then
  port=30123
  prompt='{"messages":[{"role":"user","content":"Count from 1 to 20."}],"temperature":0,"max_tokens":64}'
  smoke() {  # smoke NAME SERVE_ARGS...: start, ask once, stop; prints the reply text
    local name=$1; shift
    "$PY" -m dspark_serve.cli serve --backend sglang --port $port "$@" \
      > "${OUT:-/tmp}/sglang_$name.log" 2>&1 &
    local pid=$!
    for _ in $(seq 120); do
      curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
      kill -0 $pid 2>/dev/null || break; sleep 5
    done
    curl -sf -m 120 "http://127.0.0.1:$port/v1/chat/completions" \
      -H 'Content-Type: application/json' -d "$prompt" \
      | "$PY" -c "import json,sys; print(json.load(sys.stdin)['choices'][0]['message']['content'])"
    kill $pid 2>/dev/null; wait $pid 2>/dev/null
  }
  base=$(smoke none --speculative none)
  spec_args=(--cost-table "${DSPARK_COST_TABLE:-}")
  [[ -n "${DSPARK_DRAFT:-}" ]] && spec_args+=(--draft "$DSPARK_DRAFT")
  spec=$(smoke dspark "${spec_args[@]}")
  if [[ -n "$base" && "$base" == "$spec" ]]; then
    echo "SGLang DSPARK_SERVE greedy output equals no speculation"
  else
    echo "SGLang smoke FAILED (logs: ${OUT:-/tmp}/sglang_*.log)"; echo "none:  $base"; echo "spec:  $spec"
    status=1
  fi
else
  echo "sglang not importable: skipped (pip install 'dspark-serve[sglang]')"
fi

echo "== gpu_check: $([[ $status -eq 0 ]] && echo PASS || echo FAIL) after $SECONDS s"
exit $status
