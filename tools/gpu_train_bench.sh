#!/usr/bin/env bash
# tools/bench_train.py in one device call (nvidia-h100-x1; carry [".whl"]): the 1.3B Transformer++
# recipe at sequence 2048, micro-batch 8, bf16, mock data, three arms, each in its own process:
#   ours    the project's trainer, standard attention (recipes/transformer-pp-1.3b-100b.yaml)
#   asa     the same with --attention-variant asa (its kernel)
#   anchor  megatron-core's GPTModel, local spec, megatron-core's optimizer, real optimizer step
# WARMUP (3) + STEPS (10) steps per arm, then one profiled step per arm (--profile). The JSON is
# rewritten after each arm, so a call stopped at BENCH_TIMEOUT keeps the arms that finished.
# Carry gpu_kernel_suite.sh's .tcache.tgz.a* parts too if you have them (no ASA compiles).
#
#   source .whl/setup.sh && bash tools/gpu_train_bench.sh
#
# Back in $OUT (at most 8 files): bench_train.json (every number), bench_train.txt (the table
# and the arms' lines), gpu.txt, ARM.top30.txt (each arm's top 30 kernels/ops by self CUDA time in
# one step), logs.tgz (each arm's log, JSON and trainer config), traces.tar (ARM.trace.json.gz,
# the chrome traces, when under 16 MiB). Unpack with `tar -xzf <files_at>/logs.tgz -C /tmp/tb`.
# Knobs: RECIPE, MB, SEQ, WARMUP, STEPS, ARMS (replaces the three --arm flags), BENCH_FLAGS (more
# bench_train.py flags, e.g. "--peak-tflops 989"), TRAINER_FLAGS (after --: every arm's trainer),
# BENCH_TIMEOUT (seconds for the whole bench, default 540: a device command stops at 600).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder whose files come back}"
RECIPE=${RECIPE:-transformer-pp-1.3b-100b}; MB=${MB:-8}; SEQ=${SEQ:-2048}
WARMUP=${WARMUP:-3}; STEPS=${STEPS:-10}
export PYTHONUNBUFFERED=1
# gpu_kernel_suite.sh's Triton cache, when carried (.tcache.tgz.a*): ASA's kernels compile once
export TRITON_CACHE_DIR=$PWD/.tcache
mkdir -p "$TRITON_CACHE_DIR"
if compgen -G ".tcache.tgz.a*" > /dev/null; then cat .tcache.tgz.a* | tar -xz; fi
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
if [ -n "${ARMS:-}" ]; then
  eval "arms=($ARMS)"
else
  # ASA last: its kernels compile on a first call (minutes without a carried Triton cache)
  arms=(--arm ours=ours --arm anchor=anchor --arm "asa=ours:--attention-variant asa")
fi
work=$(mktemp -d)
set -x
timeout "${BENCH_TIMEOUT:-540}" python3 tools/bench_train.py --recipe "$RECIPE" \
  --micro-batch-size "$MB" --seq-length "$SEQ" --warmup "$WARMUP" --steps "$STEPS" --dtype bf16 \
  "${arms[@]}" --profile "$work/profile" --logs "$work/arms" --json "$OUT/bench_train.json" \
  ${BENCH_FLAGS:-} -- ${TRAINER_FLAGS:-} 2>&1 | tee "$OUT/bench_train.txt"
rc=${PIPESTATUS[0]}
set +x
cp "$work"/profile/*.top30.txt "$OUT"/ 2>/dev/null
tar -czf "$OUT/logs.tgz" -C "$work" arms $(cd "$work" && ls profile/*.txt 2>/dev/null)
# the chrome traces (already gzipped) come back when they fit one file of the call's 16 MiB
tar -cf "$OUT/traces.tar" -C "$work" $(cd "$work" && ls profile/*.trace.json.gz 2>/dev/null)
if [ "$(stat -c %s "$OUT/traces.tar" 2>/dev/null || echo 0)" -gt 16000000 ]; then
  echo "traces.tar is $(du -h "$OUT/traces.tar" | cut -f1): too large to come back, left out"
  rm -f "$OUT/traces.tar"
fi
echo "bench_train.py exit $rc"
exit "$rc"
