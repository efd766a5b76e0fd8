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
#   --kernels-only / --sglang-only     one section (each fits one 10-minute device command)
#
# With OUT set, writes $OUT/kernel_bench.json and $OUT/gpu_check.log. Exit 0 only if the
# build, the tests and every benchmark check pass.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
dry=0
kernels=1
sglang=1
bench_args=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry=1 ;;
    --quick) bench_args+=(--quick) ;;
    --kernels-only) sglang=0 ;;
    --sglang-only) kernels=0 ;;
    *) echo "usage: $0 [--dry-run] [--quick] [--kernels-only | --sglang-only]" >&2; exit 2 ;;
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
  echo "   GPU tests (pytest tests/gpu, or unittest without pytest); $PY -m dspark_serve.bench.kernels;"
  echo "   where sglang imports: DSPARK_SERVE vs no speculation on 20 MT-Bench prompts, and"
  echo "   tok/s rows for none / DSPARK / DSPARK_SERVE at concurrency 1 and 32 (< 6 min)"
  for tool in nvcc ninja; do
    command -v "$tool" >/dev/null || [[ -x "${CUDA_HOME:-/nonexistent}/bin/$tool" ]] \
      || echo "warning: $tool not found (needed for the build)"
  done
  exit 0
fi

arch=$("$PY" -c "import torch; major, minor = torch.cuda.get_device_capability(); print(f'{major}{minor}')") \
  || { echo "error: no CUDA device visible to torch" >&2; exit 2; }
status=0
if [[ $kernels -eq 1 ]]; then
  echo "== build dspark_serve._C for sm_$arch"
  start=$SECONDS
  DSPARK_BUILD_CUDA=1 DSPARK_CUDA_ARCHS="$arch" "$PY" setup.py -q build_ext --inplace \
    || { echo "error: the CUDA extension did not build" >&2; exit 1; }
  echo "built in $((SECONDS - start)) s"
  echo "== GPU tests"
  if "$PY" -c "import pytest" 2>/dev/null; then
    "$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu || status=1
  else
    "$PY" -m unittest discover -s tests/gpu -t tests/gpu -v || status=1
  fi
  echo "== benchmark"
  "$PY" -m dspark_serve.bench.kernels "${bench_args[@]}" || status=1
fi

# SGLang, the GPU-only parts (CI runs the same stack end to end on the CPU in fp32 with
# torch_native attention: tests/sglang_plugin/test_e2e_cpu.py): with CUDA graphs, flashinfer
# verify layouts, the fused Triton kernels and bf16, greedy DSPARK_SERVE == no speculation on
# 20 MT-Bench prompts, then tok/s rows for
# none / SGLang's DSPARK / DSPARK_SERVE at concurrency 1 and 32. Only where sglang imports.
# About 4-6 min on an H200: each server gets 100 s to come up, 50 s for the 20 prompts (one
# at a time, 64 tokens), 90 s for its tok/s rows, 11 s to stop. Needs a drafter for the model
# (shipped, or DSPARK_DRAFT); DSPARK_COST_TABLE is the SPS table both DSpark servers use
# (default: a flat one, which admits every positive-survival draft: right for equality; for
# speed rows profile one and pass it).
if [[ $sglang -eq 0 ]]; then
  :
elif "$PY" -c "import sglang" 2>/dev/null; then
  echo "== SGLang plugin"
  port=30123
  logs=${OUT:-/tmp}
  sglang_start=$SECONDS
  sglang_up() {  # sglang_up NAME SERVE_ARGS...: start in its own process group; sets spid
    local name=$1; shift
    setsid "$PY" -m dspark_serve.cli serve --backend sglang --port $port --enable-metrics "$@" \
      > "$logs/sglang_$name.log" 2>&1 &
    spid=$!
    local deadline=$((SECONDS + 100))
    while (( SECONDS < deadline )); do
      curl -sf -m 5 "http://127.0.0.1:$port/health" >/dev/null 2>&1 && return 0
      kill -0 $spid 2>/dev/null || break; sleep 2
    done
    echo "SGLang $name server did not come up (log: $logs/sglang_$name.log)"
    sglang_down; return 1
  }
  sglang_down() {
    kill -TERM -- -$spid 2>/dev/null
    for _ in $(seq 8); do kill -0 $spid 2>/dev/null || break; sleep 1; done
    kill -KILL -- -$spid 2>/dev/null; wait $spid 2>/dev/null; sleep 3   # GPU memory back
  }
  sglang_ask() {  # sglang_ask OUT_JSON: greedy replies to the first 20 MT-Bench prompts
    timeout 50 "$PY" - "$1" $port <<'PYEOF'
import json, sys, urllib.request
from dspark_serve.data.prompt_sets import load_prompts
replies = []
for prompt in load_prompts("mtbench", 20):
    body = json.dumps({"messages": [{"role": "user", "content": prompt}],
                       "temperature": 0, "max_tokens": 64}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[2]}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=15) as reply:
        replies.append(json.load(reply)["choices"][0]["message"]["content"])
with open(sys.argv[1], "w") as f:
    json.dump(replies, f)
PYEOF
  }
  sglang_accept_len() {  # mean accepted length (tokens per verify step) from /server_info or /metrics
    curl -sf -m 5 "http://127.0.0.1:$port/server_info" | "$PY" -c \
      "import json,sys; print(json.load(sys.stdin)['internal_states'][0]['avg_spec_accept_length'])" \
      2>/dev/null \
    || curl -sf -m 5 "http://127.0.0.1:$port/metrics" | grep -m1 '^sglang:spec_accept_length' \
    || echo "n/a"
  }
  speed_rows=$logs/sglang_speed.tsv
  : > "$speed_rows"
  sglang_speed() {  # sglang_speed NAME: aggregate and per-user tok/s at concurrency 1 and 32
    timeout 90 "$PY" - "$1" $port "$speed_rows" <<'PYEOF' || echo "$1 tok/s rows failed"
import json, statistics, sys, time, urllib.request
from concurrent.futures import ThreadPoolExecutor
from dspark_serve.data.prompt_sets import load_prompts
name, port, rows = sys.argv[1], sys.argv[2], sys.argv[3]
prompts = load_prompts("mtbench", 64)

def ask(prompt):
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "temperature": 0,
                       "max_tokens": 128, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=60) as reply:
        tokens = json.load(reply)["usage"]["completion_tokens"]
    return tokens, time.perf_counter() - start

for concurrency in (1, 32):
    n = max(8, 2 * concurrency)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(ask, prompts[:n]))
    wall = time.perf_counter() - start
    total = sum(t for t, _ in done)
    user = statistics.median(t / s for t, s in done)
    line = f"{name}\t{concurrency}\t{n}\t{total / wall:.1f}\t{user:.1f}"
    print(line.replace("\t", "  "))
    with open(rows, "a") as f:
        f.write(line + "\n")
PYEOF
  }
  table=${DSPARK_COST_TABLE:-$logs/sglang_flat_sps.json}
  if [[ -z "${DSPARK_COST_TABLE:-}" ]]; then
    "$PY" -c "from dspark_serve.scheduling.cost_table import CostTable; import sys
CostTable((1, 4096), (100.0, 100.0), 4096).save(sys.argv[1])" "$table"
  fi
  draft=${DSPARK_DRAFT:-$("$PY" -c "from dspark_serve.assets.default_drafter import shipped_drafter_path
from dspark_serve.assets.default_model import MODEL_NAME; print(shipped_drafter_path(MODEL_NAME, 'dspark') or '')")}
  spec_args=(--cost-table "$table")
  [[ -n "$draft" ]] && spec_args+=(--draft "$draft")
  sglang_ok=0
  if sglang_up none --speculative none; then
    sglang_ask "$logs/sglang_none.json" || echo "no-speculation requests failed"
    sglang_speed none
    sglang_down
    # SGLang's own DSPARK, the peer: its flags after --, same drafter and cost table.
    if sglang_up sglang_dspark --speculative none -- --speculative-algorithm DSPARK \
        --speculative-draft-model-path "$draft" --speculative-dspark-sps-table-path "$table"; then
      sglang_speed DSPARK
      echo "DSPARK mean accepted length: $(sglang_accept_len)"
      sglang_down
    fi
    if sglang_up dspark "${spec_args[@]}"; then
      sglang_ask "$logs/sglang_dspark.json" || echo "DSPARK_SERVE requests failed"
      sglang_speed DSPARK_SERVE
      echo "DSPARK_SERVE mean accepted length: $(sglang_accept_len)"
      sglang_down
      "$PY" - "$logs/sglang_none.json" "$logs/sglang_dspark.json" <<'PYEOF' && sglang_ok=1
import json, sys
base, spec = (json.load(open(p)) for p in sys.argv[1:3])
same = sum(a == b for a, b in zip(base, spec))
print(f"{same}/{len(base)} greedy DSPARK_SERVE outputs equal no speculation")
for i, (a, b) in enumerate(zip(base, spec)):
    if a != b:
        k = next(k for k in range(len(a) + 1) if a[k:k + 1] != b[k:k + 1])
        print(f"  prompt {i}: first difference at character {k}: {a[k:k + 40]!r} vs {b[k:k + 40]!r}")
sys.exit(0 if len(base) == len(spec) == 20 and same == 20 else 1)
PYEOF
    fi
  fi
  echo "tok/s (128 tokens per request, greedy, ignore_eos; cost table $table):"
  printf "%-14s %11s %9s %10s %14s\n" server concurrency requests "agg tok/s" "tok/s/user"
  while IFS=$'\t' read -r name conc n agg user; do
    printf "%-14s %11s %9s %10s %14s\n" "$name" "$conc" "$n" "$agg" "$user"
  done < "$speed_rows"
  if [[ $sglang_ok -eq 1 ]]; then
    echo "SGLang section passed in $((SECONDS - sglang_start)) s"
  else
    echo "SGLang section FAILED (logs: $logs/sglang_*.log)"; status=1
  fi
else
  echo "sglang not importable: skipped (pip install 'dspark-serve[sglang]')"
fi

echo "== gpu_check: $([[ $status -eq 0 ]] && echo PASS || echo FAIL) after $SECONDS s"
exit $status
