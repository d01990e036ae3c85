#!/usr/bin/env bash
# The study runs of docs/study.md on one GPU (device tool):
#   device: carry [".whl", "data"]; command:
#     source .whl/setup.sh && bash tools/gpu_study.sh recipes/study/lm-125m.yaml transformer-pp,asa
# Trains the named arms (all when omitted) of the study file on the docs corpus (data/, as
# tools/gpu_recipes.sh prepares it), then plots what this call trained. Configs, logs, metrics
# and summary.json go to $OUT/<study name>/ (runs/study/ without $OUT).
set -euo pipefail
study=$1; arms=${2:-}
dest=${OUT:-runs/study}/$(basename "$study" .yaml)
mkdir -p "$dest"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.tcache}
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$dest/gpu.txt"
date -u | tee -a "$dest/gpu.txt"
if [ ! -f data/docs_text_document.bin ]; then
  corpus=data/docs-corpus.jsonl.xz; [ -f $corpus ] || corpus=../shared/data/docs-corpus.jsonl.xz
  python3 tools/preprocess_data.py --input $corpus --output-prefix data/docs \
    --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model mistral --workers 12 \
    > "$dest/preprocess.log" 2>&1
fi
python3 tools/study.py run "$study" --out "$dest" ${arms:+--arms "$arms"}
python3 tools/study.py plot "$dest" --output "$dest/loss.png" || true
# the device tool returns few files: everything of this call as one archive
tar -czf "$dest.tgz" --exclude ckpt -C "$(dirname "$dest")" "$(basename "$dest")"
