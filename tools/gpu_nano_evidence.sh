#!/usr/bin/env bash
# Issue 23's "Evidence on one GPU" in ONE device call (one H100, at most 570 s of the call): a
# Nano-shaped hybrid (a random NemotronH saved with transformers, imported through the converter,
# trained briefly on docs text + NIAH, exported to HF) run through the Superlinear recipe at
# 4K -> 8K -> 16K twice, side by side: imported with Superlinear surgery, and kept dense. NIAH
# heatmaps before (the imports) and after (the last stage), tokens/s per stage. The logic is
# tools/nano_evidence.py; the settings recipes/nemotron-3-nano-superlinear/one-gpu/ (its
# evidence.yaml); the reasons recipes/nemotron-3-nano-superlinear/README.md, "Evidence on one GPU".
#
# Before the call (here, once): the wheels and the corpus
#   bash ../shared/tools/device-wheels.sh && mkdir -p data && cp ../shared/data/docs-corpus.jsonl.xz data/
# The device call (kind nvidia-h100-x1, carry [".whl", "data"]):
#   export CALL_T0=$(date +%s); source .whl/setup.sh && bash tools/gpu_nano_evidence.sh
# $OUT gets two files: nano-evidence.tgz (configs, logs, metrics, NIAH JSON + heatmaps, the
# summary; no checkpoints, weights or data) and nano-evidence.md (the summary, also printed);
# and the Triton cache's parts (below), for the next call:
#   for f in <files_at>/tcache.tgz.a*; do cp "$f" ".${f##*/}"; done
# then carry [".whl", "data", ".tcache.tgz.aa", ".tcache.tgz.ab"].
# Back here: mkdir -p /tmp/ne && tar -xzf <files_at>/nano-evidence.tgz -C /tmp/ne
#
# TWO calls (the evidence as issue 23 wants it: one call left the base 94 iterations, ~120 s, and
# it never retrieved): STAGE=base gives the base the whole first call, STAGE=arms the arms the
# whole second, the base crossing between them as at most 2 parts of 15 MiB (evidence.yaml's
# model is sized for that: 12.6M parameters, bf16 HF folder + tokenizer ~24 MB as tar.gz).
#   call A (carry [".whl", "data"], + ".tcache.tgz.aa", ... if carried):
#     export CALL_T0=$(date +%s); source .whl/setup.sh && STAGE=base bash tools/gpu_nano_evidence.sh
#   prep (tokenizer, random model, LM + base NIAH data), the base trained to the call's end less
#   export-s + base-eval-s (evidence.yaml timing), exported to HF beside its own NIAH at 1K/2K/4K
#   (evidence.yaml base.eval: does it retrieve at all? in the summary); $OUT gets
#   nano-base.tgz.aa[, .ab] (WORK/base: hf/, import/model.yaml, base.yaml, base.json, the
#   metrics, the short NIAH; more than 2 parts is an error), nano-evidence.tgz/.md, tcache parts.
#   Copy the base's parts here, with a leading dot (ignored by git):
#     for f in <files_at>/nano-base.tgz.a*; do cp "$f" ".${f##*/}"; done
#   call B (carry [".whl", "data", ".nano-base.tgz.aa", ".nano-base.tgz.ab"] (.ab only when
#   call A returned it), + a Triton cache part while the 64 MiB allow; ~19 MiB of base parts;
#   a grown cache pruned to the hybrid's kernels first: python tools/tcache.py prune
#   .tcache.tgz.a* --drop '^(asa|approx|nonapprox|ppa)_|^decode_attend' --out /tmp/tc/tcache.tgz.):
#     export CALL_T0=$(date +%s); source .whl/setup.sh && STAGE=arms bash tools/gpu_nano_evidence.sh
#   the parts unpacked into WORK/base, no random model and no base training: the arms import
#   WORK/base/hf and get the whole call (stages sized from the base's measured tokens/s, NIAH
#   before and after). Without STAGE, present .nano-base.tgz.a* mean STAGE=arms; absent, the
#   one-call pipeline above. STAGE other than base/base-more/arms, or STAGE=arms or base-more
#   without parts: exit 2 before anything is written. Remove the parts afterwards:
#   rm .nano-base.tgz.a*
# MORE base training between A and B (the base of 2026-11-27 did not retrieve after one call,
# 58.65M tokens): any number of calls with B's carry but STAGE=base-more, each followed by its
# parts copied over the old ones (rm first: a stale .ab would corrupt a 1-part base):
#     export CALL_T0=$(date +%s); source .whl/setup.sh && STAGE=base-more bash tools/gpu_nano_evidence.sh
#     rm -f .nano-base.tgz.a*; for f in <files_at>/nano-base.tgz.a*; do cp "$f" ".${f##*/}"; done
#   the parts unpacked into WORK/carried; no random model, no tokenizer training: the carried
#   HF folder imported (standard) and trained as call A trains (the whole call less export-s +
#   base-eval-s, the base's compile warm-up, its data in the carried tokenizer, NIAH samples of
#   seed base.niah.seed + round - 1), exported, its short NIAH, packed as nano-base.tgz.a* with
#   base.json counting the round and the cumulative iterations/tokens of all rounds.
#
# Arms: the first argument, a comma list of evidence.yaml's arms (default superlinear,standard);
# an unknown name stops the script (exit 2) before anything is written.
# DRY=1 (implied without nvidia-smi): the same pipeline at CPU sizes (evidence.yaml's dry block:
# a tiny NemotronH, lengths 256/512/1024, a few steps) in a few minutes.
# Knobs: PARTS_DIR (where the carried .nano-base.tgz.a* are; the repo root), CALL_T0 (the
# call's start, epoch s; default now), CALL_LIMIT (570 s from CALL_T0, the wheels' install
# included), RESERVE (20 s kept for the summary and the tarball), OUT
# (runs/nano-evidence-out), WORK (runs/nano-evidence; replaced when it holds an earlier run),
# BASE_ITERS / STAGE_ITERS=A,B,C / FIXED_ITERS=1 (iterations instead of sizing them to the clock),
# WARM_ONLY=1 (the tokenizer, the random model and the compile warm-ups of every arm's variant,
# nothing else: a call, or a gpu_parallel.sh job with TCACHE_OUT=1 at the call's level, whose
# Triton cache the evidence call carries in; the first evidence call lost its base to ~100 s of
# compiles per trainer on a 2x H200 host on 2026-11-27).
set -uo pipefail
cd "$(dirname "$0")/.."
arms=${1:-superlinear,standard}
DRY=${DRY:-}
if [ -z "$DRY" ] && ! command -v nvidia-smi > /dev/null; then DRY=1; fi
CALL_T0=${CALL_T0:-$(date +%s)}
CALL_LIMIT=${CALL_LIMIT:-570}
RESERVE=${RESERVE:-20}
OUT=${OUT:-runs/nano-evidence-out}
WORK=${WORK:-runs/nano-evidence}
dry_flag=${DRY:+--dry}
# bad input stops here, before anything is written
STAGE=${STAGE:-}
# the carried base's parts: .nano-base.tgz.a* in PARTS_DIR (default the repo root, where the
# device call's carry puts them; tests give their own folder)
PARTS_DIR=${PARTS_DIR:-.}
parts=$(compgen -G "$PARTS_DIR/.nano-base.tgz.a*" | sort | tr '\n' ' ')
case "$STAGE" in
  "") if [ -n "$parts" ]; then STAGE=arms; echo "STAGE=arms: the carried base's parts $parts"; fi ;;
  base) ;;
  arms|base-more) if [ -z "$parts" ]; then
          echo "error: STAGE=$STAGE needs the base's parts .nano-base.tgz.aa, ... in" \
               "PARTS_DIR=$PARTS_DIR (\$OUT/nano-base.tgz.a* of a STAGE=base or base-more call," \
               "copied with a leading dot)" >&2; exit 2
        fi ;;
  *) echo "error: STAGE=$STAGE: allowed base, base-more, arms (or unset: one call, or arms when" \
          ".nano-base.tgz.a* are present)" >&2; exit 2 ;;
esac
python3 tools/nano_evidence.py check --arms "$arms" $dry_flag || exit 2
if [ -e "$WORK" ]; then
  if [ -f "$WORK/timings.json" ] || [ -z "$(ls -A "$WORK")" ]; then rm -rf "$WORK"
  else echo "error: WORK=$WORK exists and holds no earlier run of this script; set WORK" >&2; exit 2; fi
fi
mkdir -p "$WORK" "$OUT"
if [ "$STAGE" = arms ] || [ "$STAGE" = base-more ]; then
  # arms: into WORK/base; base-more: into WORK/carried (WORK/base is this call's new round)
  # shellcheck disable=SC2086  # the parts' names are split's (no spaces)
  python3 tools/nano_evidence.py unpack-base --work "$WORK" --parts $parts --stage "$STAGE" \
    || { echo "error: the carried parts $parts did not unpack" >&2; exit 1; }
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# Triton's compile cache in .tcache/ (the path gpu_parallel.sh and gpu_kernel_suite.sh use: its
# index records absolute paths, so a carried cache hits only there). The first training step
# compiled for 99 s on an H200 on 2026-11-27 (Mamba-2's and the fused kernels): half the base's
# time. Carried parts (.tcache.tgz.a*) are unpacked first; TCACHE_OUT=1 (default on a GPU) packs
# the cache back as $OUT/tcache.tgz.a* (at most TCACHE_MAX_PARTS, 2: with .whl and data, 2 parts of
# 15 MiB fill a call's 64 MiB carry) for the next call's carry.
if [ -n "$DRY" ]; then export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/nano_evidence_triton}
else export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.tcache}; fi
mkdir -p "$TRITON_CACHE_DIR"
if [ -z "$DRY" ] && compgen -G ".tcache.tgz.a*" > /dev/null; then
  cat .tcache.tgz.a* | tar -xz -C "$(dirname "$TRITON_CACHE_DIR")" \
    || echo "warning: the carried .tcache.tgz.a* parts did not unpack; compiling afresh" >&2
fi
TCACHE_OUT=${TCACHE_OUT:-${DRY:+0}}; TCACHE_OUT=${TCACHE_OUT:-1}
TCACHE_MAX_PARTS=${TCACHE_MAX_PARTS:-2}
# NVLink multicast stays off on the shared machines (see the device notes)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -n "$DRY" ]; then
  echo "gpu_nano_evidence.sh: DRY run on the CPU (tiny sizes)"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$WORK/gpu.txt"
fi
deadline=$(( CALL_T0 + CALL_LIMIT - RESERVE ))
# the driver ends its steps by the deadline; timeout is the backstop that leaves the packing time
timeout -k 5 $(( deadline - $(date +%s) + 10 )) \
  python3 tools/nano_evidence.py run --arms "$arms" --work "$WORK" $dry_flag --t0 "$CALL_T0" \
  --stage "${STAGE:-all}" \
  --deadline "$deadline" ${BASE_ITERS:+--base-iters "$BASE_ITERS"} \
  ${STAGE_ITERS:+--stage-iters "$STAGE_ITERS"} ${FIXED_ITERS:+--fixed-iters} \
  ${WARM_ONLY:+--warm-only} 2>&1 \
  | tee "$WORK/driver.log"
rc=${PIPESTATUS[0]}
# STAGE=base, base-more: the base for the next call, at most 2 parts of 15 MiB (with .whl and
# data, what a call's 64 MiB carry holds); more is an error (the model is too large for two calls)
if [ "$STAGE" = base ] || [ "$STAGE" = base-more ]; then
  rm -f "$OUT"/nano-base.tgz.*
  bf16_flag=--bf16   # the GPU's export holds the checkpoint's dtype; bf16 is what Nano ships
  if [ -n "$DRY" ]; then bf16_flag=; fi
  python3 tools/nano_evidence.py pack-base --work "$WORK" --out "$OUT/nano-base.tgz." \
    --max-parts 2 $bf16_flag || rc=1
fi
# always: the summary (printed) and the one tarball, whatever ran
python3 tools/nano_evidence.py pack --work "$WORK" --tarball "$OUT/nano-evidence.tgz" \
  --summary "$OUT/nano-evidence.md" || rc=1
if [ "$TCACHE_OUT" = 1 ] && [ -d "$TRITON_CACHE_DIR" ]; then
  tdir=$(mktemp -d)
  tar -cz -C "$(dirname "$TRITON_CACHE_DIR")" "$(basename "$TRITON_CACHE_DIR")" \
    | split -b 15M - "$tdir/tcache.tgz."
  n=$(ls "$tdir" | wc -l)
  if [ "$n" -le "$TCACHE_MAX_PARTS" ]; then mv "$tdir"/tcache.tgz.* "$OUT/"
    echo "tcache: $n part(s) in $OUT: carry them next call as .tcache.tgz.aa, ..."
  else echo "tcache: $n parts, over TCACHE_MAX_PARTS=$TCACHE_MAX_PARTS: not kept"; fi
  rm -rf "$tdir"
fi
echo "gpu_nano_evidence.sh: exit $rc, $(( $(date +%s) - CALL_T0 )) s since CALL_T0; files in $OUT"
exit "$rc"
