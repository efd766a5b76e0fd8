#!/usr/bin/env bash
# Build the two carry folders of run.sh here (needs the default model's GGUF, the ShareGPT
# split in data/split, network-free): .xfer/c1 and .xfer/c2, each under one device call's
# 64 MiB together with the working tree. The tracked drafters (78 MB) must not travel: run
# `scripts/gpu_drafter/prepare.sh --hide` before the calls and `--unhide` after (they leave
# git's index and return to it; the files stay on disk).
set -euo pipefail
cd "$(dirname "$0")/../.."
big=(dspark_serve/assets/drafters/SmolLM2-135M-Instruct/{dspark,dspark-sglang,dflash}/model.safetensors)
case "${1:-}" in
  --hide) git rm -q --cached "${big[@]}"; printf '/%s\n' "${big[@]}" >> .git/info/exclude; exit ;;
  --unhide) for f in "${big[@]}"; do grep -vxF "/$f" .git/info/exclude > .git/info/x || true
              mv .git/info/x .git/info/exclude; done; git reset -q -- "${big[@]}"; exit ;;
esac
export PYTHONPATH=$PWD
x=.xfer; rm -rf $x/c1 $x/c2; mkdir -p $x/c1/cfg $x/c2
gguf=$(python -c "from dspark_serve.assets.default_model import default_gguf_path as p; print(p())")
model=$(python -c "from dspark_serve.assets.default_model import default_model_path as p; print(p())")
cp "$model"/{config.json,generation_config.json,tokenizer_config.json,chat_template.jinja} $x/c1/cfg/
python scripts/gpu_drafter/gguf_to_hf.py "$gguf" $x/c1/cfg /tmp/gguf-check --check "$model"
rm -rf /tmp/gguf-check
init=runs/shipped-dspark-16k
[[ -f $init/model.safetensors ]] || dspark-serve prune-vocab \
    --draft dspark_serve/assets/drafters/SmolLM2-135M-Instruct/dspark --out $init --size 16384
tar -cJf $x/c1/init.tar.xz -C $init config.json model.safetensors token_ranking.safetensors
[[ -f $x/sharegpt_train.npz ]] || python scripts/gpu_drafter/tokenize_sharegpt.py data/split $x/sharegpt_train.npz
xz -T2 -6 -c $x/sharegpt_train.npz > $x/c1/data.npz.xz
python -m pip download -q --no-deps -d $x/c1 gguf==0.19.0
xz -T2 -6 -c "$gguf" > $x/gguf.xz
head -c 38000000 $x/gguf.xz > $x/c1/gguf.xz.a
tail -c +38000001 $x/gguf.xz > $x/c2/gguf.xz.b
du -b -s $x/c1 $x/c2
