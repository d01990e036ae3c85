#!/usr/bin/env bash
# Issue 23 on one GPU: end-to-end decode tokens/s (and chunked prefill tokens/s) of the
# Nano-width 12-layer hybrid (tools/gpu_hybrid.sh's: MEMEM*EMEM*E, hidden 2688, 32/2 x 128
# attention, NoPE, Mamba-2 64 x 64 state 128 8 groups, 16 experts of 1856 top-6 + shared expert
# 3712, sigmoid router with expert bias, scaling 2.5, squared ReLU; random weights, bf16) at 64K,
# 256K and 1M tokens of context, with three arms in the two '*' slots:
#   superlinear  the paper's knobs (p = p_sp = 1/2, top-2, b = 2, f = 0, w = 1088: the defaults)
#   ext          "extended" b = 4, f = 2 (issue 7's)
#   standard     dense attention (SDPA over the KV cache): the baseline of the ratios
# One tools/bench_decode.py process per context, each under `timeout` (T_64K, T_256K, T_1M
# seconds); its JSON is rewritten after every arm, so a process cut short keeps the arms it
# finished. Results: $OUT/decode-<context>.json and .log, $OUT/summary.md.
#
#   mkdir -p .whl && cp ../main/.whl/* .whl/   # or: bash ../shared/tools/device-wheels.sh
#   device (one H100): carry [".whl"]; command:
#     source .whl/setup.sh && bash tools/gpu_decode_bench.sh 65536 262144     # call 1
#     source .whl/setup.sh && bash tools/gpu_decode_bench.sh 1048576          # call 2
#   (default: all three contexts in one call, T_64K + T_256K + T_1M = 560 s)
# Knobs (environment): OUT, ARMS, CHUNK (prefill chunk, 8192), STEPS (decode steps, 32), WARMUP
# (4), LAYER_STEPS (8), BATCH (1), PROFILE=1 (torch.profiler's top kernels per arm), GRAPH
# (bench_decode.py --decode-cuda-graph: off (default), on, or both: each superlinear arm also as
# LABEL-graph, its one-token attention steps through the plan captured in a CUDA graph per layer
# and capacity bucket; GRAPH=1 means both), EXTRA (more bench_decode.py flags), T_64K / T_256K /
# T_1M / T_OTHER (timeouts, s).
#   eager vs captured at 1M, superlinear and dense (one H200, ~240 s):
#     source .whl/setup.sh && ARMS=superlinear,standard GRAPH=both T_1M=230 \
#       bash tools/gpu_decode_bench.sh 1048576
set -uo pipefail
OUT=${OUT:-runs/gpu-decode}; mkdir -p "$OUT"
CONTEXTS=${*:-"65536 262144 1048576"}
ARMS=${ARMS:-"superlinear,ext=superlinear:superlinear_backward_factor=4:\
superlinear_forward_factor=2,standard"}
CHUNK=${CHUNK:-8192}; STEPS=${STEPS:-32}; WARMUP=${WARMUP:-4}; LAYER_STEPS=${LAYER_STEPS:-8}
BATCH=${BATCH:-1}
GRAPH=${GRAPH:-off}; [ "$GRAPH" = 1 ] && GRAPH=both
NANO12=(--hybrid-override-pattern "MEMEM*EMEM*E" --num-layers 12 --hidden-size 2688
  --num-attention-heads 32 --num-query-groups 2 --kv-channels 128 --ffn-hidden-size 1856
  --mamba-num-heads 64 --mamba-head-dim 64 --mamba-state-dim 128 --mamba-num-groups 8
  --mamba-impl pytorch --disable-mamba-mem-eff-path
  --num-experts 16 --moe-ffn-hidden-size 1856 --moe-shared-expert-intermediate-size 3712
  --moe-router-topk 6 --moe-router-score-function sigmoid --moe-router-enable-expert-bias
  --moe-router-topk-scaling-factor 2.5 --moe-router-dtype fp32 --squared-relu
  --position-embedding-type none --init-method-std 0.0173 --vocab-size 131072 --bf16)
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
for ctx in $CONTEXTS; do
  case $ctx in
    65536) t=${T_64K:-110} ;; 262144) t=${T_256K:-170} ;; 1048576) t=${T_1M:-280} ;;
    *) t=${T_OTHER:-200} ;;
  esac
  echo "== context $ctx: arms $ARMS, decode CUDA graph $GRAPH, timeout ${t}s" \
    | tee -a "$OUT/plan.txt"
  timeout -k 10 "$t" python3 tools/bench_decode.py --contexts "$ctx" --variants "$ARMS" \
    --prefill-chunk "$CHUNK" --decode-steps "$STEPS" --warmup-steps "$WARMUP" \
    --layer-steps "$LAYER_STEPS" --batch-size "$BATCH" ${PROFILE:+--profile} \
    --decode-cuda-graph "$GRAPH" \
    --json "$OUT/decode-$ctx.json" ${EXTRA:-} -- "${NANO12[@]}" 2>&1 \
    | grep -v -i "warn" | tee "$OUT/decode-$ctx.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || echo "context $ctx: exit $rc (124: the timeout; the JSON keeps the arms done)" \
    | tee -a "$OUT/plan.txt"
done
python3 - "$OUT" <<'EOF'
import glob, json, os, sys
sys.path.insert(0, os.getcwd())
from tools.bench_decode import add_ratios, table
out = sys.argv[1]
rows, meta = [], {}
for path in sorted(glob.glob(os.path.join(out, "decode-*.json"))):
    data = json.load(open(path))
    meta = data["meta"]
    rows += data["results"]
order = [a["label"] for a in meta.get("arms", [])]
rows.sort(key=lambda r: (r["context"], order.index(r["arm"]) if r["arm"] in order else 99))
add_ratios(rows, meta.get("baseline"))
text = table(rows, meta.get("baseline"))
head = (f"{meta.get('device')}, {meta.get('dtype')}, {meta.get('host')} {meta.get('pattern')}, "
        f"Mamba mixer {meta.get('mamba_mixer')}, batch {meta.get('batch')}, prefill chunk "
        f"{meta.get('prefill_chunk')}, {meta.get('decode_steps')} decode steps, model step eager "
        f"(no whole-model CUDA graph); superlinear attention step captured: "
        f"{meta.get('decode_cuda_graph', 'off')} (*-graph arms)")
open(os.path.join(out, "summary.md"), "w").write(head + "\n\n" + text + "\n")
print(head); print(text)
EOF
