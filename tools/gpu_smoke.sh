#!/usr/bin/env bash
# GPU smoke runs of the trainer on 2 GPUs: standard and asa, each with TP=2 + SP and with PP=2,
# 220 iterations of a 12-layer, 768-hidden GPT (Mistral tokenizer, 2048-token sequences, global
# batch 32) on the documentation corpus. Logs and a summary table go to $OUT.
#
# From the project root, on this machine once:
#   bash ../shared/tools/device-wheels.sh                      # .whl/ + .whl/setup.sh (git-ignored)
#   mkdir -p data && cp ../shared/data/docs-corpus.jsonl.xz data/   # 7.7 MB; /data/ is git-ignored
# then through the device tool (kind nvidia-h200-x2, carry [".whl", "data"]):
#   source .whl/setup.sh && bash tools/gpu_smoke.sh            # all four runs (~6-8 minutes)
#   source .whl/setup.sh && bash tools/gpu_smoke.sh asa_tp2sp  # a subset, by run name
# Kernel vs reference ops (issues 6, 7): the same run with "_ref" appended uses the PyTorch
# reference ops; the summary then compares the two loss curves iteration by iteration, e.g.
#   ITERS=50 EXTRA="--num-layers 4 --hidden-size 512 --num-attention-heads 4 --log-interval 1" \
#     bash tools/gpu_smoke.sh asa_tp2sp asa_tp2sp_ref
#
# A dry run of the script itself on the CPU (tiny model, a corpus slice):
#   NGPU=2 MAX_DOCS=200 ITERS=4 EXTRA="--num-layers 2 --hidden-size 64 --num-attention-heads 4
#     --seq-length 64 --micro-batch-size 2 --global-batch-size 4 --no-bf16 --lr-warmup-iters 1
#     --eval-interval 2 --eval-iters 1 --log-interval 1 --num-workers 0" bash tools/gpu_smoke.sh
#
# RUN_TIMEOUT=<seconds> stops any one run after that long (its summary row then covers what it logged);
# PORT: the rendezvous port (default 29500), to run several invocations side by side (same OUT and
# WORK); SUMMARY_ONLY=1 then trains nothing and writes the summary of the named runs' logs.
# $OUT/summary.md: one row per run (loss first -> last, validation loss, mean tokens/s/GPU,
# TFLOP/s/GPU, MFU, peak memory); $OUT/<run>.log: the trainer's output.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_smoke}
WORK=${WORK:-/tmp/gpu_smoke}
mkdir -p "$OUT" "$WORK"
# NVLink multicast stays off on the shared machines (see the device notes)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
NGPU=${NGPU:-2}
ITERS=${ITERS:-220}

CORPUS=${CORPUS:-data/docs-corpus.jsonl.xz}
[ -f "$CORPUS" ] || CORPUS=../shared/data/docs-corpus.jsonl.xz
PREFIX="$WORK/docs"
if [ -z "${SUMMARY_ONLY:-}" ] && [ ! -f "${PREFIX}_text_document.idx" ]; then
  python3 tools/preprocess_data.py --input "$CORPUS" --output-prefix "$PREFIX" \
    --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model mistral \
    --workers "$(( $(nproc) > 16 ? 16 : $(nproc) ))" --no-progress \
    ${MAX_DOCS:+--max-documents "$MAX_DOCS"} | tee "$WORK/preprocess.log"
fi

COMMON=(
  --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 2048
  --micro-batch-size 4 --global-batch-size 32 --train-iters "$ITERS"
  --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 20
  --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --bf16 --use-distributed-optimizer
  --data-path "${PREFIX}_text_document" --split 98,2,0 --data-cache-path "$WORK/cache"
  --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model mistral --num-workers 2
  --log-interval 10 --eval-interval 110 --eval-iters 4
)
# run names: <variant>_<layout>[_packed][_ref]; "std" is the standard variant, "_packed" adds
# --reset-attention-mask (documents packed at their EODs), "_ref" forces the PyTorch reference ops
# (--subq-impl reference) for a kernel-vs-reference loss-curve comparison
declare -A LAYOUT=(
  [tp2sp]="--tensor-model-parallel-size 2 --sequence-parallel"
  [pp2]="--pipeline-model-parallel-size 2"
)
RUNS=("$@")
[ ${#RUNS[@]} -gt 0 ] || RUNS=(std_tp2sp std_pp2 asa_tp2sp asa_pp2)

run_flags() {  # run name -> trainer flags
  local name=$1 impl="" packed="" variant layout
  if [[ $name == *_ref ]]; then impl="--subq-impl reference"; name=${name%_ref}; fi
  if [[ $name == *_packed ]]; then packed="--reset-attention-mask"; name=${name%_packed}; fi
  variant=${name%_*}; layout=${name##*_}
  [ "$variant" = std ] && variant=standard
  [ -n "${LAYOUT[$layout]+x}" ] || { echo "unknown layout in run $1 (have: ${!LAYOUT[*]})" >&2; return 2; }
  echo "--attention-variant $variant ${LAYOUT[$layout]} $packed $impl"
}

status=0
for run in "${RUNS[@]}"; do
  flags=$(run_flags "$run") || exit 2
  [ -z "${SUMMARY_ONLY:-}" ] || continue
  rm -f "$WORK/$run.jsonl"
  # shellcheck disable=SC2206
  cmd=(${RUN_TIMEOUT:+timeout "$RUN_TIMEOUT"} python3 -m torch.distributed.run --nproc-per-node "$NGPU"
       --master-port "${PORT:-29500}" examples/pretrain_gpt.py
       "${COMMON[@]}" $flags --metrics-file "$WORK/$run.jsonl" ${EXTRA:-})
  echo "\$ ${cmd[*]}" | tee "$OUT/$run.log"
  if ! "${cmd[@]}" >> "$OUT/$run.log" 2>&1; then
    echo "run $run FAILED (tail of $OUT/$run.log):"; tail -30 "$OUT/$run.log"; status=1
  fi
done

python3 - "$WORK" "$OUT" "${RUNS[@]}" <<'EOF'
import json, re, sys
work, out, runs = sys.argv[1], sys.argv[2], sys.argv[3:]
rows = ["| run | iters | lm loss first10 -> last10 | valid loss | tokens/s/GPU | TFLOP/s/GPU | MFU | peak mem (GB) |",
        "|---|---|---|---|---|---|---|---|"]
for run in runs:
    try:
        recs = [json.loads(l) for l in open(f"{work}/{run}.jsonl")]
    except FileNotFoundError:
        rows.append(f"| {run} | failed | | | | | | |"); continue
    train = [r for r in recs if "lm_loss" in r]
    valid = [r for r in recs if "valid_loss" in r]
    steady = train[10:] or train  # skip warm-up iterations for throughput
    mean = lambda k: sum(r[k] for r in steady) / len(steady)
    log = open(f"{out}/{run}.log").read()
    mfu = re.findall(r"MFU: ([0-9.]+)%", log)
    mem = re.findall(r"peak memory \(GB\): ([0-9.]+)", log)
    first = sum(r["lm_loss"] for r in train[:10]) / min(10, len(train))
    last = sum(r["lm_loss"] for r in train[-10:]) / min(10, len(train))
    tflops = mean("tflops_per_gpu")
    rows.append(f"| {run} | {len(train)} | {first:.3f} -> {last:.3f} | "
                f"{valid[-1]['valid_loss'] if valid else float('nan'):.3f} | {mean('tokens_per_sec_per_gpu'):,.0f} | "
                f"{tflops:.1f} | {100 * tflops / 989.0:.1f}% (log: {mfu[-1] if mfu else '-'}%) | "
                f"{mem[-1] if mem else '-'} |")
# kernel vs reference: the same run with and without "_ref", iteration by iteration
pairs = [(r[:-4], r) for r in runs if r.endswith("_ref") and r[:-4] in runs]
if pairs:
    rows += ["", "| kernel run | vs reference | iterations | max abs diff lm loss (at it.) | mean abs diff | "
             "max rel diff | last loss kernel / reference |", "|---|---|---|---|---|---|---|"]
for run, ref in pairs:
    try:
        losses = [{r["iteration"]: r["lm_loss"] for r in map(json.loads, open(f"{work}/{x}.jsonl"))
                   if "lm_loss" in r} for x in (run, ref)]
    except FileNotFoundError:
        rows.append(f"| {run} | {ref} | failed | | | | |"); continue
    its = sorted(set(losses[0]) & set(losses[1]))
    if not its:
        rows.append(f"| {run} | {ref} | 0 | | | | |"); continue
    diff = {i: abs(losses[0][i] - losses[1][i]) for i in its}
    worst = max(its, key=diff.get)
    rel = max(diff[i] / abs(losses[1][i]) for i in its)
    rows.append(f"| {run} | {ref} | {len(its)} | {diff[worst]:.4f} ({worst}) | "
                f"{sum(diff.values()) / len(its):.4f} | {100 * rel:.2f}% | "
                f"{losses[0][its[-1]]:.4f} / {losses[1][its[-1]]:.4f} |")
open(f"{out}/summary.md", "w").write("\n".join(rows) + "\n")
print("\n".join(rows))
EOF
exit $status
