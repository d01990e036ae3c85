#!/usr/bin/env bash
# The kernels' GPU checks and benchmarks in few device calls (one GPU: nvidia-h100-x1).
#
# Device time is scarce and Triton compiles on the device are slow (about 20 s per kernel
# specialisation), so this script (1) keeps Triton's cache in .tcache/ and hands it back as
# $OUT/tcache.tgz.a* parts — carry them into the next call (`carry: [".whl", ".tcache.tgz.aa", …]`)
# and nothing is compiled twice; (2) compiles in parallel: each GPU test file runs in its own
# process (16 CPU cores, tests are compile-bound) before anything is timed; (3) packs every log
# and JSON into $OUT/logs.tgz (a call returns at most 8 files).
#
# From the project root on the device, after `source .whl/setup.sh`:
#   bash tools/gpu_kernel_suite.sh tests            # every kernel's GPU tests (pytest -m gpu)
#   bash tools/gpu_kernel_suite.sh asa              # ASA's GPU tests, then asa-bench
#   bash tools/gpu_kernel_suite.sh asa-bench        # ASA's default vs the baselines, 2K to 128K
#   bash tools/gpu_kernel_suite.sh sparse-bench     # PPA, Superlinear prefill benchmarks; Superlinear profile
#   bash tools/gpu_kernel_suite.sh deconstructed    # nonapprox, approx: GPU tests, then the table
#   bash tools/gpu_kernel_suite.sh superlinear-ab   # superlinear options: GPU tests, then A/B
#   SL_AB='{"fused_mix": true}' bash tools/gpu_kernel_suite.sh superlinear-bench  # the A/B only
#   bash tools/gpu_kernel_suite.sh profile          # nonapprox, approx: per-kernel and host time
#   APPROX_AB='{"scan": "sequential"}' bash tools/gpu_kernel_suite.sh approx-ab  # approx A/B
#   bash tools/gpu_kernel_suite.sh ppa-long         # PPA vs cuDNN at 32K and 64K
#   SLP_AB='{"group_search": false}' bash tools/gpu_kernel_suite.sh superlinear-prefill  # prefill A/B, decode
#   ASA_AB='{"BV_out": 64};{"delta_warps": 4}' ASA_CANDIDATE='{"BV_out": 64}' \
#     bash tools/gpu_kernel_suite.sh asa-candidates # A/B launch configs; GPU tests under one
#   bash tools/gpu_kernel_suite.sh linear-check     # asa + nonapprox GPU tests, graph timings
#   GPU_FILES=asa_kernel GPU_K=fused bash tools/gpu_kernel_suite.sh gpu-tests  # tests only
#   DECODE_AB='{"mma": true}' bash tools/gpu_kernel_suite.sh decode-sweep  # decode launches, 1M
#   bash tools/gpu_kernel_suite.sh tests asa        # several stages in one call
# Each stage stops after STAGE_TIMEOUT seconds (default 420) and a call after 600: without a
# carried cache, run one stage per call (compiling is most of the first call's time).
# Back here: `mkdir -p /tmp/s && tar -xzf <files_at>/logs.tgz -C /tmp/s`, and
# `cp <files_at>/tcache.tgz.a* .` for the next call (.tcache* is git-ignored via .git/info/exclude).
set -uo pipefail
cd "$(dirname "$0")/.."
R=$PWD
: "${OUT:?OUT must name the folder whose files come back}"
LOGS=$OUT/logs
mkdir -p "$LOGS"
export TRITON_CACHE_DIR=$R/.tcache PYTHONUNBUFFERED=1
mkdir -p "$TRITON_CACHE_DIR"
if compgen -G ".tcache.tgz.a*" > /dev/null; then cat .tcache.tgz.a* | tar -xz; fi
CALL_START=$(mktemp) && sleep 1  # entries newer than this file were compiled by this call
BENCH="python3 $R/tools/bench_ops.py"
STAGE_TIMEOUT=${STAGE_TIMEOUT:-420}

stage_tests() {
  # run from /tmp: at the repository root, ./megatron_subq would shadow the installed package
  local pids=() f
  for f in asa_kernel nonapprox_kernel approx_kernel ppa_kernel superlinear_kernel superlinear_decode gpu_modules; do
    (cd /tmp && timeout "$STAGE_TIMEOUT" python3 -m pytest -q -p no:cacheprovider -m gpu -s \
       "$R/tests/test_$f.py" > "$LOGS/test_$f.log" 2>&1; echo "rc $?" >> "$LOGS/test_$f.log") &
    pids+=($!)
  done
  wait "${pids[@]}"
  for f in "$LOGS"/test_*.log; do echo "$(basename "$f"): $(grep -E '(passed|failed|error|skipped)' "$f" | tail -1)"; done
}

gpu_tests() {
  # every GPU test id of the given test files (those matching $GPU_K if set) in its own process,
  # $GPU_P (15) at a time: a test's time is almost all Triton compiling, one core per process
  # (fewer where the fp32 references need GPU memory: superlinear's ran out at 15).
  # Log: $LOGS/tests_$1.log
  local tag=$1; shift
  (cd /tmp && python3 -m pytest -q -p no:cacheprovider -m gpu -k "${GPU_K:-}" --collect-only "$@" 2>/dev/null \
     | grep '::' | sed "s|^tests/|$R/tests/|" > "$LOGS/ids_$tag.txt")
  # GPU_TESTS_BUDGET (s): stop the remaining ids then, so that the call still packs its logs
  (cd /tmp && timeout "${GPU_TESTS_BUDGET:-86400}" xargs -P "${GPU_P:-15}" -I{} -d '\n' \
     timeout "$STAGE_TIMEOUT" python3 -m pytest -q -s -rA \
     -p no:cacheprovider -m gpu "{}" < "$LOGS/ids_$tag.txt" > "$LOGS/tests_$tag.log" 2>&1)
  echo "$tag: $(wc -l < "$LOGS/ids_$tag.txt") test ids; $(grep -cE '^[0-9]+ passed' "$LOGS/tests_$tag.log") passed," \
       "$(grep -cE '^[0-9]+ (passed, )?[0-9]* ?(failed|error)' "$LOGS/tests_$tag.log") failed/errors"
  grep -E '(FAILED|ERROR|Error|rc 1)' "$LOGS/tests_$tag.log" | head -20
}

stage_asa() {
  # ASA alone after a kernel change: its GPU tests, then stage_asa_bench
  gpu_tests asa "$R/tests/test_asa_kernel.py"
  stage_asa_bench
}

stage_asa_bench() {
  # ASA's default launch against the baselines, 2K to 128K (where the time goes: per kernel,
  # and on the host at short lengths)
  timeout "$STAGE_TIMEOUT" $BENCH --ops asa --baselines dense,fla \
    --lengths 2048,4096,8192,16384,32768,65536,131072 --profile --host-profile 50 --cuda-graph \
    --json "$LOGS/bench_asa.json" > "$LOGS/bench_asa.log" 2>&1
  grep -v '^{' "$LOGS/bench_asa.log" | grep -v '^ *[0-9.]* us ' | tail -30
}

stage_ppa_long() {
  # PPA where the issue measures it (64K) without the slow baselines: our kernel and cuDNN only
  timeout "$STAGE_TIMEOUT" $BENCH --ops ppa --baselines dense --ppa-dense-gap 8 --ppa-flex-max-len 0 \
    --lengths 32768,65536 --profile --json "$LOGS/bench_ppa_long.json" > "$LOGS/bench_ppa_long.log" 2>&1
  grep -v '^{' "$LOGS/bench_ppa_long.log" | grep -v '^ *[0-9.]* us ' | tail -12
}

stage_asa_check() {
  # after a change of ASA's launch options: the GPU tests matching $GPU_K (e.g. GPU_K=
  # "launch_options"), then the default against the options of $ASA_AB (';'-separated JSON)
  # at 16K and 64K, three repeats each
  gpu_tests asa "$R/tests/test_asa_kernel.py"
  local args=(--asa-launch '{}') cands c
  IFS=';' read -ra cands <<< "${ASA_AB:-}"
  for c in "${cands[@]}"; do args+=(--asa-launch "$c"); done
  timeout "$STAGE_TIMEOUT" $BENCH --ops asa --baselines dense,fla --lengths 16384,65536 --profile \
    --repeat 3 --cuda-graph "${args[@]}" \
    --json "$LOGS/bench_asa_check.json" > "$LOGS/bench_asa_check.log" 2>&1
  grep -v '^{' "$LOGS/bench_asa_check.log" | grep -v '^ *[0-9.]* us ' | tail -12
}

stage_deconstructed() {
  # nonapprox and approx: their GPU tests, then the benchmark table of docs/benchmarks.md
  gpu_tests deconstructed "$R/tests/test_nonapprox_kernel.py" "$R/tests/test_approx_kernel.py"
  timeout "$STAGE_TIMEOUT" $BENCH --ops nonapprox,approx --baselines dense \
    --lengths 2048,4096,8192,16384,32768,65536 --cuda-graph \
    --json "$LOGS/bench_deconstructed.json" > "$LOGS/bench_deconstructed.log" 2>&1
  grep -v '^{' "$LOGS/bench_deconstructed.log" | tail -26
}

stage_approx_ab() {
  # approx's launch options against its default (APPROX_AB: ';'-separated JSON overrides, e.g.
  # '{"scan": "sequential"}'), fwd and fwd+bwd, CUDA-graph timing, at 16K and 64K
  local args=(--approx-launch '{}') cands c
  IFS=';' read -ra cands <<< "${APPROX_AB:-}"
  for c in "${cands[@]}"; do args+=(--approx-launch "$c"); done
  timeout "$STAGE_TIMEOUT" $BENCH --ops approx --baselines dense --lengths 16384,65536 --profile \
    --cuda-graph "${args[@]}" --json "$LOGS/bench_approx_ab.json" > "$LOGS/bench_approx_ab.log" 2>&1
  grep -E '^(graph|profile)' "$LOGS/bench_approx_ab.log"
}

stage_graphs() {
  # CUDA-graph capture of every op's fwd+bwd (tests), then the host's share of a short step
  GPU_K=graph GPU_P=${GPU_P:-5} gpu_tests graphs "$R/tests/test_asa_kernel.py" \
    "$R/tests/test_nonapprox_kernel.py" "$R/tests/test_approx_kernel.py" \
    "$R/tests/test_ppa_kernel.py" "$R/tests/test_superlinear_kernel.py"
  (cd /tmp && python3 "$R/tools/host_overhead.py" --json "$LOGS/host_overhead.json" 2>&1 | tail -30)
}

stage_linear_check() {
  # after a change to the linear-time kernels: the GPU tests of asa and nonapprox (one
  # process per id), then asa's default against
  # $ASA_ALT (a launch option being decided), nonapprox, eager and CUDA-graph timings, and
  # the host breakdown of a short step
  gpu_tests linear "$R/tests/test_asa_kernel.py" "$R/tests/test_nonapprox_kernel.py"
  timeout "$STAGE_TIMEOUT" $BENCH --ops asa,nonapprox --baselines dense,fla \
    --lengths "${LIN_LENGTHS:-2048,16384,65536}" --profile --cuda-graph \
    --asa-launch '{}' ${ASA_ALT:+--asa-launch "$ASA_ALT"} \
    --json "$LOGS/bench_linear.json" > "$LOGS/bench_linear.log" 2>&1
  grep -v '^{' "$LOGS/bench_linear.log" | grep -v '^ *[0-9.]* us ' | tail -40
  (cd /tmp && timeout 120 python3 "$R/tools/host_overhead.py" --json "$LOGS/host_overhead.json" \
     2>&1 | tail -40)
}

stage_asa_candidates() {
  # ASA launch configurations against the default, CUDA-graph timing at 16K and 64K (ASA_AB:
  # ';'-separated JSON overrides), then, with ASA_CANDIDATE set, ASA's GPU tests (GPU_K,
  # default: the reference comparisons) run under that override — what a new default needs
  local args=(--asa-launch '{}') cands c
  IFS=';' read -ra cands <<< "${ASA_AB:-}"
  for c in "${cands[@]}"; do args+=(--asa-launch "$c"); done
  timeout "$STAGE_TIMEOUT" $BENCH --ops asa --baselines dense --lengths 16384,65536 --profile \
    --cuda-graph "${args[@]}" --json "$LOGS/bench_asa_candidates.json" \
    > "$LOGS/bench_asa_candidates.log" 2>&1
  grep -E '^(graph|profile)' "$LOGS/bench_asa_candidates.log"
  if [ -n "${ASA_CANDIDATE:-}" ]; then
    MEGATRON_SUBQ_ASA_LAUNCH=$ASA_CANDIDATE GPU_K=${GPU_K:-matches_reference_gpu} \
      gpu_tests asa "$R/tests/test_asa_kernel.py"
  fi
}

stage_gpu_tests() {
  # the GPU tests of the test files named in $GPU_FILES (e.g. "asa_kernel approx_kernel"),
  # those matching $GPU_K, one process per id: to re-test one change without a benchmark
  local files=() f
  for f in ${GPU_FILES:?GPU_FILES names the test files, e.g. asa_kernel}; do
    files+=("$R/tests/test_$f.py")
  done
  gpu_tests "${GPU_TAG:-selected}" "${files[@]}"
}

stage_superlinear_tests() {
  # every superlinear GPU test (kernel and decode), $GPU_P (3) at a time: their fp32 references
  # need GPU memory
  GPU_P=${GPU_P:-3} gpu_tests superlinear "$R/tests/test_superlinear_kernel.py" \
    "$R/tests/test_superlinear_decode.py"
}

stage_superlinear_ab() {
  # superlinear's launch options (kernels/superlinear/launch.py: launch_options): their GPU
  # tests (the options-off path included), then the benchmark of stage_superlinear_bench
  GPU_P=${GPU_P:-4} GPU_K="launch_options or matches_reference_gpu or graph" gpu_tests \
    superlinear "$R/tests/test_superlinear_kernel.py"
  stage_superlinear_bench
}

stage_superlinear_bench() {
  # the default against cuDNN, then each launch override of $SL_AB (';'-separated JSON; default:
  # the torch glue, i.e. the fifth session's four glue options off), one process each
  local launches launch tag
  local glue_off='{"fused_merge": false, "fused_mix": false, "gate_kernel": false, "sorted_pairs": false}'
  IFS=';' read -ra launches <<< "{};${SL_AB:-$glue_off}"
  for launch in "${launches[@]}"; do
    tag=$(echo "$launch" | tr -dc 'a-z_')
    MEGATRON_SUBQ_SUPERLINEAR_LAUNCH=$launch timeout "$STAGE_TIMEOUT" $BENCH --ops superlinear \
      --baselines "$([ "$launch" = '{}' ] && echo dense)" --heads 16 \
      --lengths "${SL_LENGTHS:-16384,32768,65536}" --profile --json "$LOGS/bench_sl_$tag.json" \
      > "$LOGS/bench_sl_$tag.log" 2>&1
    echo "superlinear launch $launch:"; grep -E '^ +[0-9]+ ' "$LOGS/bench_sl_$tag.log"
    grep -E '^profile' "$LOGS/bench_sl_$tag.log"
  done
}

stage_sparse_bench() {
  timeout "$STAGE_TIMEOUT" $BENCH --ops ppa --ppa-dense-gap 8,32 --ppa-flex-max-len 8192 \
    --lengths 4096,8192,16384,32768,65536,131072,262144 --profile \
    --json "$LOGS/bench_ppa.json" > "$LOGS/bench_ppa.log" 2>&1
  grep -v '^{' "$LOGS/bench_ppa.log" | tail -40
  timeout "$STAGE_TIMEOUT" $BENCH --ops superlinear_prefill --heads 32 --kv-heads 2 \
    --lengths 16384,32768,65536 --json "$LOGS/bench_slp.json" > "$LOGS/bench_slp.log" 2>&1
  grep -v '^{' "$LOGS/bench_slp.log" | tail -20
  timeout "$STAGE_TIMEOUT" $BENCH --ops superlinear --heads 16 --lengths 16384,65536 --profile \
    --json "$LOGS/bench_sl_profile.json" > "$LOGS/bench_sl_profile.log" 2>&1
  grep -v '^{' "$LOGS/bench_sl_profile.log" | tail -40
}

stage_decode_sweep() {
  # the superlinear decode kernels' launches: their GPU tests (decode, the captured step in
  # generation), then chunk x launch (DECODE_AB: ';'-separated JSON of block_n, warps, mma) at
  # DECODE_LENGTHS, eager / plan / graph-step rows against SDPA decode (Nemotron layout)
  GPU_P=${GPU_P:-4} gpu_tests decode "$R/tests/test_superlinear_decode.py" \
    "$R/tests/test_superlinear_decode_graph.py"
  local args=() cands c
  IFS=';' read -ra cands <<< "${DECODE_AB:-{\}}"
  for c in "${cands[@]}"; do args+=(--superlinear-decode-launch "$c"); done
  timeout "$STAGE_TIMEOUT" $BENCH --ops superlinear_decode --baselines "" --heads 32 --kv-heads 2 \
    --lengths "${DECODE_LENGTHS:-1048576}" --superlinear-decode-chunk "${DECODE_CHUNKS:-256,512}" \
    "${args[@]}" --repeat "${DECODE_REPEAT:-1}" --json "$LOGS/bench_decode_${DECODE_TAG:-sweep}.json" \
    > "$LOGS/bench_decode_${DECODE_TAG:-sweep}.log" 2>&1
  grep -v '^{' "$LOGS/bench_decode_${DECODE_TAG:-sweep}.log" | grep -v '^ *[0-9.]* us ' | tail -90
}

stage_superlinear_prefill() {
  # Superlinear prefill (chunked) at the Nemotron layout (32 query / 2 KV heads) with per-kernel
  # profiles, the default and each launch override of $SLP_AB (';'-separated JSON), one process
  # each; SLP_LENGTHS (default 32K, 64K); then decode at 64K and 1M unless SLP_DECODE=0
  local launches launch tag
  IFS=';' read -ra launches <<< "{}${SLP_AB:+;$SLP_AB}"
  for launch in "${launches[@]}"; do
    tag=$(echo "$launch" | tr -dc 'a-z0-9_')
    MEGATRON_SUBQ_SUPERLINEAR_LAUNCH=$launch timeout "$STAGE_TIMEOUT" $BENCH \
      --ops superlinear_prefill --heads 32 --kv-heads 2 --profile \
      --baselines "$([ "$launch" = '{}' ] && echo dense)" --lengths "${SLP_LENGTHS:-32768,65536}" \
      --json "$LOGS/bench_slp_$tag.json" > "$LOGS/bench_slp_$tag.log" 2>&1
    echo "superlinear prefill, launch $launch:"
    grep -E '^ +[0-9]+ |^profile|^ +[0-9.]+ us' "$LOGS/bench_slp_$tag.log" | head -40
  done
  [ "${SLP_DECODE:-1}" = 0 ] && return
  timeout "$STAGE_TIMEOUT" $BENCH --ops superlinear_decode --baselines "" --heads 32 --kv-heads 2 \
    --profile --lengths 65536,1048576 --json "$LOGS/bench_sld.json" > "$LOGS/bench_sld.log" 2>&1
  grep -v '^{' "$LOGS/bench_sld.log" | tail -30
}

stage_profile() {
  # where nonapprox's and approx's time goes at a short and a long length: per-kernel CUDA time,
  # how busy the GPU is kept, and the host's share (asa has its own stage)
  timeout "$STAGE_TIMEOUT" $BENCH --ops nonapprox,approx --baselines dense --lengths 2048,16384 \
    --profile --host-profile 50 --json "$LOGS/bench_profile.json" > "$LOGS/bench_profile.log" 2>&1
  grep -v '^{' "$LOGS/bench_profile.log" | tail -60
}

nvidia-smi --query-gpu=name --format=csv,noheader
for stage in "$@"; do
  case $stage in
    tests) stage_tests ;;
    asa) stage_asa ;;
    asa-bench) stage_asa_bench ;;
    approx-ab) stage_approx_ab ;;
    asa-check) stage_asa_check ;;
    deconstructed) stage_deconstructed ;;
    superlinear-ab) stage_superlinear_ab ;;
    superlinear-bench) stage_superlinear_bench ;;
    graphs) stage_graphs ;;
    linear-check) stage_linear_check ;;
    asa-candidates) stage_asa_candidates ;;
    superlinear-tests) stage_superlinear_tests ;;
    gpu-tests) stage_gpu_tests ;;
    sparse-bench) stage_sparse_bench ;;
    profile) stage_profile ;;
    superlinear-prefill) stage_superlinear_prefill ;;
    decode-sweep) stage_decode_sweep ;;
    ppa-long) stage_ppa_long ;;
    *) echo "unknown stage $stage (have: tests asa asa-bench approx-ab asa-check deconstructed superlinear-ab graphs linear-check asa-candidates superlinear-bench superlinear-tests gpu-tests sparse-bench profile ppa-long superlinear-prefill decode-sweep)"; exit 2 ;;
  esac
done
tar -czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
# TCACHE_NEW_ONLY=1: hand back only what this call compiled (a call returns ~60 MB at most)
if [ -n "${TCACHE_NEW_ONLY:-}" ]; then find .tcache -type f ! -newer "$CALL_START" -delete; fi
tar -cz .tcache | split -b 15M - "$OUT/tcache.tgz."
ls -la "$OUT"
