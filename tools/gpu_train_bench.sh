#!/usr/bin/env bash
# tools/bench_train.py in one device call (nvidia-h100-x1; carry [".whl"]): the 1.3B Transformer++
# recipe at sequence 2048, micro-batch 8, bf16, mock data, five arms, each in its own process:
#   ours        the project's trainer, standard attention (recipes/transformer-pp-1.3b-100b.yaml)
#   ours-fused  the same with every fusion that runs without TE/apex ($FUSED below: the Triton
#               RMSNorm and RoPE, megatron-core's SwiGLU, bias-dropout-add and cross-entropy
#               fusions, torch's fused AdamW; docs/training.md, "Fused kernels")
#   anchor      megatron-core's GPTModel, local spec, megatron-core's optimizer, real optimizer
#               step, with --recompute-granularity selective: its unfused DotProductAttention keeps
#               3 GiB of attention probabilities per layer (72 GiB over 24 layers) and ran out of
#               memory without it even on a 139 GiB H200; selective recompute of core attention
#               is what a Megatron-LM user does (bench_train.py prints the estimate per arm)
#   asa         ours with --attention-variant asa (its kernel)
#   asa-fused   asa with $FUSED
# WARMUP (3) + STEPS (10) steps per arm, then one profiled step for the arms of PROFILE_ARMS. The
# JSON is rewritten after each arm, so a call stopped at BENCH_TIMEOUT keeps the arms that
# finished. Carry gpu_kernel_suite.sh's .tcache.tgz.a* parts too if you have them (no ASA compiles).
#
#   source .whl/setup.sh && bash tools/gpu_train_bench.sh
#   DRY=1 bash tools/gpu_train_bench.sh      # the same arms on the CPU, tiny model (no OUT needed)
#
# Back in $OUT, four files at most (a device call returns 8, 16 MiB each):
#   bench_train.txt  the GPU, the anchor's memory estimate, each arm's command line, the table
#   bench_train.json every number (tools/bench_train.py's --json)
#   bench.tgz        each arm's log, JSON and trainer config (arms/), the profiled arms' top-30
#                    tables (profile/ARM.top30.txt); `tar -xzf <files_at>/bench.tgz -C /tmp/tb`
#   traces.tar       the profiled arms' chrome traces (ARM.trace.json.gz), as many as fit 16 MB
#                    (those left out are named in bench_train.txt)
# Knobs: RECIPE, MB, SEQ, WARMUP, STEPS, ARMS (replaces the five --arm flags), PROFILE_ARMS
# (comma-separated arm names to profile, default ours,ours-fused; "all" or "none"), BENCH_FLAGS
# (more bench_train.py flags, e.g. "--peak-tflops 989"), TRAINER_FLAGS (after --: every arm's
# trainer), ARM_TIMEOUT (seconds per arm, default 300), BENCH_TIMEOUT (seconds for the whole
# bench, default 540: a device command stops at 600), DRY (1: CPU, tiny-cpu recipe, mb 2 x 64,
# 1 + 2 steps, Triton's interpreter for the fused kernels; $OUT defaults to a temp folder).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=${DRY:-}
FUSED="--subq-fused-norm --subq-fused-rope --bias-swiglu-fusion --bias-dropout-fusion"
FUSED="$FUSED --cross-entropy-loss-fusion --subq-fused-adam"
if [ -n "$DRY" ]; then
  OUT=${OUT:-$(mktemp -d /tmp/gpu_train_bench.XXXXXX)}
  RECIPE=${RECIPE:-tiny-cpu}; MB=${MB:-2}; SEQ=${SEQ:-64}; WARMUP=${WARMUP:-1}; STEPS=${STEPS:-2}
  BENCH_FLAGS="--vocab-size 256 --peak-tflops 1 ${BENCH_FLAGS:-}"
  export TRITON_INTERPRET=1  # the fused RMSNorm and RoPE kernels on CPU tensors
fi
: "${OUT:?OUT must name the folder whose files come back}"
mkdir -p "$OUT"
RECIPE=${RECIPE:-transformer-pp-1.3b-100b}; MB=${MB:-8}; SEQ=${SEQ:-2048}
WARMUP=${WARMUP:-3}; STEPS=${STEPS:-10}; PROFILE_ARMS=${PROFILE_ARMS:-ours,ours-fused}
export PYTHONUNBUFFERED=1
summary=$OUT/bench_train.txt
if [ -n "$DRY" ]; then
  echo "gpu_train_bench.sh: DRY run on the CPU (recipe $RECIPE, tiny shapes)" | tee "$summary"
else
  # gpu_kernel_suite.sh's Triton cache, when carried (.tcache.tgz.a*): ASA's kernels compile once
  export TRITON_CACHE_DIR=$PWD/.tcache
  mkdir -p "$TRITON_CACHE_DIR"
  if compgen -G ".tcache.tgz.a*" > /dev/null; then cat .tcache.tgz.a* | tar -xz; fi
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$summary"
fi
if [ -n "${ARMS:-}" ]; then
  eval "arms=($ARMS)"
else
  # the A/B of the fused path first; ASA last (its kernels compile on a first call: minutes
  # without a carried Triton cache)
  arms=(--arm ours=ours --arm "ours-fused=ours:$FUSED"
        --arm "anchor=anchor:--recompute-granularity selective"
        --arm "asa=ours:--attention-variant asa"
        --arm "asa-fused=ours:--attention-variant asa $FUSED")
fi
work=$(mktemp -d)
profile=(--profile "$work/profile")
case "$PROFILE_ARMS" in
  none) profile=() ;;
  all) ;;
  *) profile+=(--profile-arms "$PROFILE_ARMS") ;;
esac
set -x
timeout "${BENCH_TIMEOUT:-540}" python3 tools/bench_train.py --recipe "$RECIPE" \
  --micro-batch-size "$MB" --seq-length "$SEQ" --warmup "$WARMUP" --steps "$STEPS" --dtype bf16 \
  --timeout "${ARM_TIMEOUT:-300}" "${arms[@]}" "${profile[@]}" --logs "$work/arms" \
  --json "$OUT/bench_train.json" ${BENCH_FLAGS:-} -- ${TRAINER_FLAGS:-} 2>&1 | tee -a "$summary"
rc=${PIPESTATUS[0]}
set +x
# everything else in one tarball: logs, trainer configs, per-arm JSON, top-30 tables
mkdir -p "$work/profile"
tar -czf "$OUT/bench.tgz" -C "$work" arms $(cd "$work" && ls profile/*.txt 2>/dev/null)
# the chrome traces (already gzipped), as many as fit one returned file (16 MiB, with a margin)
traces=(); total=0; limit=${TRACE_LIMIT:-16000000}
for f in "$work"/profile/*.trace.json.gz; do
  [ -e "$f" ] || continue
  size=$(stat -c %s "$f")
  if (( total + size + 1024 * (${#traces[@]} + 1) + 10240 <= limit )); then
    traces+=("profile/$(basename "$f")"); total=$(( total + size ))
  else
    echo "trace $(basename "$f") ($(( size / 1000000 )) MB) left out of traces.tar: over the" \
         "16 MB a returned file may have" | tee -a "$summary"
  fi
done
if (( ${#traces[@]} > 0 )); then tar -cf "$OUT/traces.tar" -C "$work" "${traces[@]}"; fi
echo "bench_train.py exit $rc; files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')" | tee -a "$summary"
rm -rf "$work"
exit "$rc"
