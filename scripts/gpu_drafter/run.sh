#!/usr/bin/env bash
# Issue-15 drafter training on a lent GPU (one H100/H200, no registry), in two device calls
# because the target's GGUF file (98 MB) and the rest exceed one call's 64 MiB:
#   call 1 carries .xfer/c1 (GGUF part a, warm-start drafter, tokenized data, gguf wheel)
#          and runs `run.sh smoke`: the whole job on a random target of the same shape
#   call 2 carries .xfer/c2 (GGUF part b) and runs `run.sh train SECONDS`
# Prepared here by scripts/gpu_drafter/prepare.sh. Everything it writes comes back in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
start=$(date +%s)
mode=${1:?usage: run.sh smoke|train [SECONDS]}
seconds=${2:-540}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
W=/tmp/dspark-gpu; mkdir -p $W
exec > >(tee "$OUT/run_$mode.log") 2>&1
python3 -m pip install -q --no-index --no-deps --target $W/site .xfer/c1/*.whl || exit 3
export PYTHONPATH="$PYTHONPATH:$W/site"
[[ -d $W/init ]] || { mkdir -p $W/init && tar -xJf .xfer/c1/init.tar.xz -C $W/init; } || exit 3
[[ -f $W/data.npz ]] || xz -dc .xfer/c1/data.npz.xz > $W/data.npz || exit 3
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
common=(--data $W/data.npz --init $W/init --work $W/$mode --export "$OUT")
if [[ $mode == smoke ]]; then
  python3 scripts/gpu_drafter/train_gpu.py --random-target .xfer/c1/cfg "${common[@]}" \
      --max-seqs 400 --deadline $((start + 75)) --eval-every 10
else
  [[ -f .xfer/c2/gguf.xz.b ]] || { echo "missing .xfer/c2/gguf.xz.b"; exit 3; }
  cat .xfer/c1/gguf.xz.a .xfer/c2/gguf.xz.b | xz -dc -T8 > $W/target.gguf || exit 3
  python3 scripts/gpu_drafter/gguf_to_hf.py $W/target.gguf .xfer/c1/cfg $W/target || exit 3
  python3 scripts/gpu_drafter/train_gpu.py --target $W/target "${common[@]}" \
      --deadline $((start + seconds))
fi
