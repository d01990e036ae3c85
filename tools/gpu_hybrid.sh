#!/usr/bin/env bash
# The hybrid host's GPU runs behind docs/hybrid.md and docs/results.md, on one GPU (device tool):
#   bash ../shared/tools/device-wheels.sh           # .whl/ (megatron-core, mamba-ssm Triton-only, ...)
#   mkdir -p data && cp ../shared/data/docs-corpus.jsonl.xz data/
#   device: carry [".whl", "data"]; command:
#     source .whl/setup.sh && bash tools/gpu_hybrid.sh [mixer] [train] [bench]
# mixer: megatron's MambaMixer (mamba_ssm Triton kernels) against SubqMambaMixer, forward and every
#        gradient (tests/test_mamba2.py -m gpu).
# train: a Nano-shaped hybrid that fits one GPU — Nano's widths (hidden 2688, Mamba-2 64 x 64,
#        state 128, 8 groups; 32/2 x 128 attention, NoPE; experts of 1856 top-6 with the shared
#        expert of 3712, sigmoid router with expert bias, scaling 2.5, squared ReLU) but 12 layers
#        (MEMEM*EMEM*E: 5 M, 5 E, 2 *) and 16 experts — ITERS (200) iterations on the docs corpus
#        with standard, then superlinear, in the '*' slots; logs in $OUT.
# bench: tools/bench_hybrid_layers.py, the full-width Nano group M, E, * at 4K/16K/64K tokens.
set -euo pipefail
OUT=${OUT:-runs/gpu-hybrid}; mkdir -p "$OUT"
ITERS=${ITERS:-200}; SEQS=${SEQS:-"4096 16384 65536"}; VARIANTS=${VARIANTS:-"standard superlinear"}
modes=${*:-mixer train bench}
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
for mode in $modes; do case $mode in
mixer)
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_mamba2.py -rs 2>&1 | tail -20 \
    | tee "$OUT/mixer-test.log" ;;
train)
  if [ ! -f data/docs_text_document.bin ]; then
    corpus=data/docs-corpus.jsonl.xz; [ -f $corpus ] || corpus=../shared/data/docs-corpus.jsonl.xz
    python3 tools/preprocess_data.py --input $corpus --output-prefix data/docs \
      --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model mistral --workers 8 \
      ${MAX_DOCS:+--max-documents $MAX_DOCS} > "$OUT/preprocess.log" 2>&1
  fi
  for v in $VARIANTS; do
    python3 examples/pretrain_hybrid.py \
      --hybrid-override-pattern "MEMEM*EMEM*E" --num-layers 12 --hidden-size 2688 \
      --num-attention-heads 32 --num-query-groups 2 --kv-channels 128 --ffn-hidden-size 1856 \
      --mamba-num-heads 64 --mamba-head-dim 64 --mamba-state-dim 128 --mamba-num-groups 8 \
      --mamba-impl megatron --disable-mamba-mem-eff-path \
      --num-experts 16 --moe-ffn-hidden-size 1856 --moe-shared-expert-intermediate-size 3712 \
      --moe-router-topk 6 --moe-router-score-function sigmoid --moe-router-enable-expert-bias \
      --moe-router-topk-scaling-factor 2.5 --moe-router-dtype fp32 \
      --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4 --squared-relu \
      --position-embedding-type none --init-method-std 0.0173 --attention-variant "$v" \
      --seq-length 4096 --micro-batch-size 2 --global-batch-size 8 --train-iters "$ITERS" \
      --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 20 --weight-decay 0.1 \
      --clip-grad 1.0 --bf16 --data-path data/docs_text_document --split 98,2,0 \
      --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model mistral --num-workers 2 \
      --log-interval 20 --eval-interval "$ITERS" --eval-iters 8 \
      --metrics-file "$OUT/train-$v.jsonl" 2>&1 | grep -v -i "warn" | tee "$OUT/train-$v.log" | \
      grep -E "megatron_subq|iteration +[0-9]+/|validation|Error|error" || true
  done ;;
bench)
  python3 tools/bench_hybrid_layers.py --variants $VARIANTS --seq $SEQS \
    --json "$OUT/bench-hybrid-layers.json" 2>&1 | grep -v -i warn | tee "$OUT/bench.log" ;;
*) echo "unknown mode $mode (mixer, train, bench)"; exit 2 ;;
esac; done
