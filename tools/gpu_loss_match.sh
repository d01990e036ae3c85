#!/usr/bin/env bash
# Issue 21's loss-curve evidence in ONE device call (one GPU): does the fused path change the
# math, and which fusion moves the curve? The 1.3B Transformer++ recipe
# (recipes/transformer-pp-1.3b-100b.yaml, the model tools/bench_train.py / gpu_train_bench.sh
# time) at sequence 2048, bf16, for ITERS iterations on the docs corpus
# (data/docs-corpus.jsonl.xz, Mistral tokenizer), the arms of ARMS with the same seed, data,
# global batch and schedule (so the same samples in the same order), one after another:
#   unfused  the default local path, micro-batch MB, global batch GB
#   control  unfused at micro-batch CONTROL_MB (same global batch, more accumulation): the same
#            math up to bf16 summation order, the bf16-noise yardstick (issue 25's control)
#   fused    the same with --subq-fused-norm --subq-fused-rope --bias-swiglu-fusion
#            --bias-dropout-fusion --cross-entropy-loss-fusion --subq-fused-adam (or FUSED_FLAGS)
#   fused-<fusion>  unfused + that one flag, for each of the six (fused-subq-fused-norm, ...,
#            fused-cross-entropy-loss-fusion, fused-subq-fused-adam); fused-each names all six
# They run in that order whatever the order in ARMS, so the reference and the yardstick exist even
# when the clock cuts the last arms. Schedule: WARMUP iterations of linear warm-up (default
# ITERS/10, at least 1), cosine decay over the rest; the recipe's 5 of 50 is unstable on the 1.3B
# (grad norm up to 258), which amplifies rounding differences, so a bisection wants a longer one.
# Then tools/loss_match.py compares each arm with unfused over the iterations it, unfused and the
# control reached (a cut arm does not shorten the others): max abs diff, mean abs diff, mean abs
# over the last LAST (30) iterations, mean signed. Verdict rule, for fused and each fused-<fusion>
# arm: "within bf16 noise" when its max abs AND mean abs differences are each at most NOISE_TOL
# (1.0) x the control's over the same iterations; else "larger than bf16 noise"; "no verdict"
# without its or the control's losses. The summary's top verdict is the fused arm's; with
# fused-<fusion> arms it has a verdict per arm (the JSON's "verdicts"). (The control is one draw
# of the noise: ratios a little above 1 say little; the JSON and the plot give them.)
#
# Sizing (H200, docs/benchmarks.md "End-to-end"): each arm ~35 s start-up (1.3B build, dataset
# index, first-step compiles) + ITERS x ~0.7 s (GB 16 = 2 micro-batches of MB 8: ~0.77 s unfused,
# ~0.63 s fused; the control's 4 of CONTROL_MB 4 ~0.8-0.9 s), plus ~10 s preprocessing (13.8M
# tokens; none when data/docs_text_document.* is carried). The default three arms at 50
# iterations: ~3 x 70 s = ~210 s + 10 s. Nine arms (unfused,control,fused,fused-each) at ITERS 40:
# ~9 x 63 s = ~570 s, more than the ~545 s before the default stop (CALL_LIMIT 570 - RESERVE 25):
# the last arm (fused-subq-fused-adam) is cut short or not started, and compared on what it
# reached; ITERS 30 (~9 x 56 s = ~505 s) fits. Every arm stops at the deadline anyway (below), so
# a slower GPU gives fewer iterations, still compared; to hold the call to a budget, e.g. 330 s,
# set CALL_LIMIT=330 (the wheels' install after CALL_T0 counts too).
#
# Before the call (here, once): the wheels and the corpus
#   bash ../shared/tools/device-wheels.sh && mkdir -p data && cp ../shared/data/docs-corpus.jsonl.xz data/
# The device call (kind nvidia-h100-x1, carry [".whl", "data"]):
#   export CALL_T0=$(date +%s); source .whl/setup.sh && bash tools/gpu_loss_match.sh
# or, bisecting the six fusions against one reference and one control in the same call:
#   export CALL_T0=$(date +%s); source .whl/setup.sh &&
#     ARMS=unfused,control,fused,fused-each ITERS=40 WARMUP=20 bash tools/gpu_loss_match.sh
# or as one job of tools/gpu_parallel.sh: 'loss::bash tools/gpu_loss_match.sh'
# $OUT gets two files: loss-match.tgz (loss_match.json, loss_match.md, loss_match.png, the
# trainer config, each arm's log and metrics file, gpu.txt; no checkpoint, no data) and
# loss_match.md (the summary, also printed). Back here:
#   mkdir -p /tmp/lm && tar -xzf <files_at>/loss-match.tgz -C /tmp/lm
#
# The clock: the call's deadline is CALL_T0 + CALL_LIMIT (570 s; CALL_T0 default now), or
# JOB_DEADLINE (epoch s, set by gpu_parallel.sh) when earlier. Arms run under `timeout`, stopped
# RESERVE (25 s) before it; an arm starts only with MIN_RUN (45 s; DRY 5) left, and takes at most
# ARM_TIMEOUT (300 s). The comparison and the tarball always run, on whatever iterations the arms
# reached. Nothing is saved (no --save).
# DRY=1 (implied without nvidia-smi): the same pipeline on the CPU: the recipe at a tiny shape
# (2 layers, hidden 64, seq 128, bf16: --cross-entropy-loss-fusion refuses fp32), ITERS 6, GB 4,
# MB 2, CONTROL_MB 1, the first MAX_DOCS (200) documents; ~3 minutes on two idle cores. The
# Triton RMSNorm/RoPE fall back to PyTorch on CPU tensors unless DRY_INTERPRET=1 (Triton's
# interpreter: ~25 s per iteration at this size).
# Knobs: ARMS (unfused,fused,control; unfused is required; also fused-each and fused-<fusion>),
# ITERS (50), WARMUP (ITERS/10, at least 1; a whole number < ITERS), MB (8), GB (16),
# CONTROL_MB (MB/2), LAST (30), NOISE_TOL (1.0), RECIPE (transformer-pp-1.3b-100b), CALL_T0,
# CALL_LIMIT, JOB_DEADLINE, RESERVE, MIN_RUN, ARM_TIMEOUT, OUT (runs/loss-match-out; DRY: a temp
# folder), WORK (a new temp folder; one given must be empty or hold an earlier run, which is
# replaced), EXTRA (more trainer flags for every arm), MAX_DOCS (DRY only by default),
# FUSED_FLAGS (the fused arm's fusions, a comma list of subq-fused-norm, subq-fused-rope,
# bias-swiglu-fusion, bias-dropout-fusion, cross-entropy-loss-fusion, subq-fused-adam; default all;
# the fused-<fusion> arms take one each, in the same run).
# Bad input (an unknown arm, a non-positive ITERS, WARMUP >= ITERS, GB not a multiple of MB, ...)
# stops the script with exit 2 and a message naming the variable, before anything is written.
set -uo pipefail
cd "$(dirname "$0")/.."
die() { echo "gpu_loss_match.sh: $*" >&2; exit 2; }
DRY=${DRY:-}
if [ -z "$DRY" ] && ! command -v nvidia-smi > /dev/null; then DRY=1; fi
if [ -n "$DRY" ]; then
  ITERS=${ITERS:-6}; MB=${MB:-2}; GB=${GB:-4}; MIN_RUN=${MIN_RUN:-5}; MAX_DOCS=${MAX_DOCS:-200}
else
  ITERS=${ITERS:-50}; MB=${MB:-8}; GB=${GB:-16}; MIN_RUN=${MIN_RUN:-45}; MAX_DOCS=${MAX_DOCS:-}
fi
ARMS=${ARMS:-unfused,fused,control}
[[ $MB =~ ^[0-9]+$ ]] && (( MB >= 2 )) && CONTROL_MB=${CONTROL_MB:-$(( MB / 2 ))}
CONTROL_MB=${CONTROL_MB:-1}
LAST=${LAST:-30}; NOISE_TOL=${NOISE_TOL:-1.0}; RECIPE=${RECIPE:-transformer-pp-1.3b-100b}
CALL_LIMIT=${CALL_LIMIT:-570}; RESERVE=${RESERVE:-25}; ARM_TIMEOUT=${ARM_TIMEOUT:-300}
for v in CALL_LIMIT RESERVE MIN_RUN ARM_TIMEOUT; do
  [[ ${!v} =~ ^[0-9]+$ ]] || die "$v='${!v}': not a whole number of seconds"
done
CALL_T0=${CALL_T0:-$(date +%s)}
[[ $CALL_T0 =~ ^[0-9]+$ ]] || die "CALL_T0='$CALL_T0': not epoch seconds (export CALL_T0=\$(date +%s))"
DEADLINE=$(( CALL_T0 + CALL_LIMIT ))
if [ -n "${JOB_DEADLINE:-}" ]; then
  [[ $JOB_DEADLINE =~ ^[0-9]+$ ]] || die "JOB_DEADLINE='$JOB_DEADLINE': not epoch seconds"
  (( JOB_DEADLINE < DEADLINE )) && DEADLINE=$JOB_DEADLINE
fi
STOP=$(( DEADLINE - RESERVE ))   # every arm ends by then; the comparison and the tarball after
(( STOP > $(date +%s) )) || die "CALL_LIMIT/JOB_DEADLINE less RESERVE=$RESERVE s is already past"
knobs=(--arms "$ARMS" --iters "$ITERS" --warmup "${WARMUP:-}" --mb "$MB" --gb "$GB"
       --control-mb "$CONTROL_MB" --last "$LAST" --tol "$NOISE_TOL" --fused-flags "${FUSED_FLAGS:-}")
python3 tools/loss_match.py check "${knobs[@]}" > /dev/null || exit 2
[ -f "recipes/$RECIPE.yaml" ] || [ -f "$RECIPE" ] ||
  die "RECIPE='$RECIPE': no recipes/$RECIPE.yaml and no such file"
corpus=${SUBQ_CORPUS:-data/docs-corpus.jsonl.xz}
[ -f "$corpus" ] || corpus=../shared/data/docs-corpus.jsonl.xz
data=""
if [ -z "$DRY" ] && [ -f data/docs_text_document.bin ] && [ -f data/docs_text_document.idx ]; then
  data=data/docs_text_document   # preprocessed before the call and carried
elif [ ! -f "$corpus" ]; then
  die "no docs corpus: data/docs-corpus.jsonl.xz (carry data/), ../shared/data/docs-corpus.jsonl.xz or SUBQ_CORPUS"
fi
if [ -n "${WORK:-}" ] && [ -e "$WORK" ]; then
  if [ -f "$WORK/knobs.json" ] || [ -z "$(ls -A "$WORK")" ]; then rm -rf "$WORK"
  else die "WORK=$WORK exists and holds no earlier run of this script; set another WORK"; fi
fi
# -- from here on, things are written
if [ -n "$DRY" ]; then OUT=${OUT:-$(mktemp -d /tmp/gpu_loss_match.out.XXXXXX)}; fi
OUT=${OUT:-runs/loss-match-out}
WORK=${WORK:-$(mktemp -d /tmp/gpu_loss_match.XXXXXX)}
mkdir -p "$OUT" "$WORK"
OUT=$(cd "$OUT" && pwd); WORK=$(cd "$WORK" && pwd)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$WORK/triton}
# NVLink multicast stays off on the shared machines (see the device notes)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
stamp() { echo "[gpu_loss_match $(date -u +%T) +$(( $(date +%s) - CALL_T0 ))s] $*"; }
if [ -n "$DRY" ]; then
  stamp "DRY run on the CPU (tiny shape of $RECIPE)" | tee "$WORK/gpu.txt"
  [ -n "${DRY_INTERPRET:-}" ] && export TRITON_INTERPRET=1
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
else
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$WORK/gpu.txt"
fi

rc=0
if [ -z "$data" ]; then
  stamp "preprocessing $corpus (Mistral tokenizer${MAX_DOCS:+, first $MAX_DOCS documents})"
  # the command of gpu_multi.sh's data_prefix (and gpu_recipes.sh), into WORK
  mkdir -p "$WORK/data"
  left=$(( STOP - $(date +%s) )); (( left >= 1 )) || left=1   # timeout 0 would mean none
  timeout "$left" python3 tools/preprocess_data.py --input "$corpus" \
    --output-prefix "$WORK/data/docs" --tokenizer-type GPTSentencePieceTokenizer \
    --tokenizer-model mistral --workers "$(( $(nproc) > 16 ? 16 : $(nproc) ))" --no-progress \
    ${MAX_DOCS:+--max-documents "$MAX_DOCS"} > "$WORK/preprocess.log" 2>&1 || {
      echo "preprocessing failed: $WORK/preprocess.log" >&2; tail -20 "$WORK/preprocess.log" >&2; rc=1; }
  data=$WORK/data/docs_text_document
fi
python3 tools/loss_match.py plan "${knobs[@]}" --work "$WORK" --data "$data" --recipe "$RECIPE" \
  ${DRY:+--dry} || rc=1

if (( rc == 0 )); then
  while IFS=$'\t' read -r arm flags; do
    left=$(( STOP - $(date +%s) ))
    if (( left < MIN_RUN )); then
      stamp "arm $arm not started: ${left} s left before the stop (MIN_RUN=$MIN_RUN)"
      echo "not started: ${left} s left" > "$WORK/$arm.log"; rc=1; continue
    fi
    budget=$(( left < ARM_TIMEOUT ? left : ARM_TIMEOUT ))
    stamp "arm $arm ($budget s at most): ${flags:-(no extra flags)} ${EXTRA:-}"
    # shellcheck disable=SC2086  # flags and EXTRA are lists of trainer flags
    timeout -k 10 "$budget" python3 examples/pretrain_gpt.py --config "$WORK/base.yaml" $flags \
      ${EXTRA:-} --metrics-file "$WORK/$arm.jsonl" < /dev/null > "$WORK/$arm.log" 2>&1
    arm_rc=$?
    n=$( [ -f "$WORK/$arm.jsonl" ] && wc -l < "$WORK/$arm.jsonl" || echo 0)
    (( arm_rc == 124 || arm_rc == 137 )) && stamp "arm $arm stopped at its time limit ($budget s)"
    stamp "arm $arm: exit $arm_rc, $n iterations logged"
    if (( arm_rc != 0 )); then
      rc=1; grep -E "Error|error" "$WORK/$arm.log" | grep -vi warn | tail -3
    fi
  done < "$WORK/arms.tsv"
fi

# always: the comparison on whatever all arms reached, and the one tarball
if [ -f "$WORK/knobs.json" ]; then
  python3 tools/loss_match.py compare --work "$WORK" --json "$WORK/loss_match.json" \
    --md "$WORK/loss_match.md" --plot "$WORK/loss_match.png" || rc=1
  [ -f "$WORK/loss_match.md" ] && cp "$WORK/loss_match.md" "$OUT/loss_match.md"
fi
tar -czf "$OUT/loss-match.tgz" -C "$WORK" --exclude=./data --exclude=./cache --exclude=./triton .
stamp "exit $rc; files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
exit "$rc"
