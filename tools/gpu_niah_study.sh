#!/usr/bin/env bash
# Study 3 of docs/study.md on one GPU (device tool):
#   device: carry [".whl", "data"]; command:
#     source .whl/setup.sh && bash tools/gpu_niah_study.sh superlinear,standard
# Makes the NIAH training sets (seed 1, haystacks from the whole docs corpus; deterministic, so
# every call makes the same ones), trains the named arms of recipes/study/niah-superlinear.yaml
# through tools/study.py, and evaluates each arm's final checkpoint with tools/niah.py on held-out
# samples (seed 2, haystacks from documents 3000 on) -> $OUT/niah-superlinear/<arm>.niah.{json,png}.
# DATA_ONLY=1: only the training sets (then arms can run as parallel calls with their own OUT).
set -euo pipefail
arms=${1:-superlinear,standard,window-only}
dest=${OUT:-runs/study}/niah-superlinear
mkdir -p "$dest" data
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.tcache}
corpus=data/docs-corpus.jsonl.xz; [ -f $corpus ] || corpus=../shared/data/docs-corpus.jsonl.xz
tok="--tokenizer-type GPTSentencePieceTokenizer --tokenizer-model mistral"
for spec in 2k:2048:150 8k:8192:40; do (
  IFS=: read -r tag len per <<< "$spec"
  if [ ! -f data/niah${tag}_text_document.bin ]; then
    python3 tools/niah.py generate $tok --corpus $corpus --lengths $len --depths 0,5,...,100 \
      --samples-per-cell $per --seed 1 --format train --no-progress --output data/niah$tag.jsonl
    python3 tools/preprocess_data.py --input data/niah$tag.jsonl --output-prefix data/niah$tag \
      $tok --workers 8 > "$dest/preprocess-$tag.log" 2>&1
  fi ) &
done
wait
[ -n "${DATA_ONLY:-}" ] && exit 0
bash tools/gpu_study.sh recipes/study/niah-superlinear.yaml "$arms"
for arm in ${arms//,/ }; do
  timeout "${EVAL_TIMEOUT:-300}" python3 tools/niah.py eval --load "$dest/ckpt/$arm.stage2" --lengths 2048,4096,8192 \
    --depths 0,10,...,100 --samples-per-cell 5 --seed 2 --corpus $corpus --skip-documents 3000 \
    --output "$dest/$arm.niah.json" --plot "$dest/$arm.niah.png" > "$dest/$arm.niah.log" 2>&1 \
    || echo "niah eval of $arm failed: $dest/$arm.niah.log"
done
rm -rf "$dest/ckpt"
tar -czf "$dest.tgz" -C "$(dirname "$dest")" "$(basename "$dest")"
