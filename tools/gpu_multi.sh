#!/usr/bin/env bash
# Issue 25's multi-GPU runs on one 4-GPU host (device kind nvidia-h100-x4 / nvidia-h200-x4), one
# stage per item, each stage sized for one device call (at most 10 minutes), several where they fit:
#   twonode  item 1: recipes/slurm/train.sbatch as a two-node job on one host (the stand-ins of
#            tests/data/fake_slurm: two torchrun agents, --nnodes 2, c10d on localhost, "node" 0
#            on GPUs 0,1 and "node" 1 on GPUs 2,3), ASA 1.3B at TP=2 (+SP) x DP=2. Run A
#            uninterrupted; run B has "node" 1 killed (SIGKILL to its agent and workers) KILL_AFTER
#            iterations after its first checkpoint, requeues itself (fake scontrol records it), and
#            its next attempt (SLURM_RESTART_COUNT=1) resumes from that checkpoint. Summary: A vs B
#            loss per iteration (max / mean abs diff, before and after the resume), tokens/s of
#            each attempt, wall time of A and of B's two attempts.
#   scaling  item 2: Transformer++ 1.3B and ASA 1.3B at 1, 2, 4 GPUs (DP) and TP=2 (+SP) x DP=2,
#            weak scaling (micro-batch MB per DP rank, global batch MB x GPUs: the same tokens per
#            GPU per iteration everywhere); tokens/s/GPU and efficiency vs the same model on 1 GPU.
#            Runs that fit side by side share the host (1-GPU, 1-GPU and 2-GPU runs at once on
#            disjoint GPUs; SERIAL=1: one at a time, ~2x longer).
#   hybrid   item 3: the Nano-width hybrid of tools/gpu_hybrid.sh (12 layers MEMEM*EMEM*E, 16
#            experts top-6, 1.31B parameters: the largest Nano-shaped layout measured on one H100)
#            with superlinear in the '*' slots, HYB_ITERS (50) iterations, on 1 GPU and on 4 GPUs at
#            TP=2 + SP, EP=2 (expert TP 2), CP=2: same data, seed and global batch, and the same
#            initial weights (saved once by a 1-GPU launch, loaded by both with --finetune: the
#            trainer draws experts differently under EP); per-iteration loss diff.
#   longctx  item 4: the GPT 1.3B (Transformer++ shape) with asa, superlinear and standard at
#            LONG_SEQ (131072) tokens, CP=4, full recomputation, micro-batch 1; tokens/s/GPU and
#            peak memory per GPU.
# Which ASA: ASA_SHAPE=tpp (default) is ASA on the Transformer++ shape (16 heads x 128, SwiGLU
# 5632: recipes/transformer-pp-1.3b-100b.yaml with --attention-variant asa), which runs on ASA's
# Triton kernel (head dims up to 256); ASA_SHAPE=paper is the ASA paper's shape
# (recipes/asa-1.3b-100b.yaml: 4 heads x 512, SiLU 8192, selective recompute) which has no kernel
# above head dim 256 yet and runs on the PyTorch reference, ~8x slower (4,568 tokens/s on one H100,
# docs/results.md): twonode then fits ~60 iterations per call, not 200 (set TWONODE_ITERS=60).
#
# Before the device calls, here (once): the wheels and the corpus (7.7 MB; each call preprocesses
# it into $WORK in ~5-10 s, 13.8M Mistral tokens, unless data/docs_text_document.{bin,idx} exist):
#   bash ../shared/tools/device-wheels.sh && mkdir -p data && cp ../shared/data/docs-corpus.jsonl.xz data/
# The device calls, in order (kind nvidia-h100-x4, carry [".whl", "data"]; $OUT comes back with
# <stage>.md, <stage>-logs.tgz and gpu.txt; each invocation stops its runs CALL_LIMIT=570 s after
# CALL_T0, the call's start, wheels' install included):
#   1. export CALL_T0=$(date +%s); source .whl/setup.sh && bash tools/gpu_multi.sh twonode          # ~8-9 min
#   2. export CALL_T0=$(date +%s); source .whl/setup.sh && bash tools/gpu_multi.sh scaling          # ~7-9 min
#   3. export CALL_T0=$(date +%s); source .whl/setup.sh && bash tools/gpu_multi.sh hybrid longctx   # ~9.5 min
#  (4. only if 3 skipped standard: ... && LONG_RUNS=standard_cp4 bash tools/gpu_multi.sh longctx  # ~2.5 min)
# (docs/results.md, "Issue 25: the multi-GPU runs, ready to run", has the expected minutes and why.)
# Back here: `mkdir -p /tmp/m && tar -xzf <files_at>/<stage>-logs.tgz -C /tmp/m`.
#
# A dry run of the script's logic on the CPU (gloo, tiny models, a corpus slice, 4 processes):
#   DRY=1 bash tools/gpu_multi.sh twonode scaling hybrid longctx
# (DRY=1 is implied when nvidia-smi is missing; it sets tiny shapes, --no-bf16, few iterations.)
#
# Knobs: NGPU (4), OUT (runs/gpu_multi), WORK (/tmp/gpu_multi), CALL_LIMIT (570 s for the whole
# invocation: a run is started only with MIN_RUN (60 s) left and is stopped RESERVE (25 s) before
# it, leaving time for the summaries), RUN_TIMEOUT (480 s per run), PORT (29600), ASA_SHAPE,
# TWONODE_ITERS (200), TWONODE_SAVE (iterations between checkpoints, TWONODE_ITERS/2), KILL_AFTER (10),
# TWONODE_MB (4) / TWONODE_GBS (16), SCALING_RUNS, SCALING_ITERS (30), WARM (10), MB (8 for the
# Transformer++ shape, 4 for ASA_SHAPE=paper), SERIAL, HYB_ITERS (50), LONG_RUNS
# ("asa_cp4 superlinear_cp4 standard_cp4"), LONG_SEQ (131072), LONG_ITERS (8), EXTRA (more trainer
# flags for every run).
set -uo pipefail
cd "$(dirname "$0")/.."
R=$PWD
OUT=${OUT:-runs/gpu_multi}
WORK=${WORK:-/tmp/gpu_multi}
mkdir -p "$OUT" "$WORK"
OUT=$(cd "$OUT" && pwd)
# the call's clock: from CALL_T0 (epoch seconds, set before `source .whl/setup.sh`) when given
START=$(( SECONDS - ( $(date +%s) - ${CALL_T0:-$(date +%s)} ) ))
CALL_LIMIT=${CALL_LIMIT:-570}
RUN_TIMEOUT=${RUN_TIMEOUT:-480}
RESERVE=${RESERVE:-25}
MIN_RUN=${MIN_RUN:-60}
NGPU=${NGPU:-4}
PORT=${PORT:-29600}
ASA_SHAPE=${ASA_SHAPE:-tpp}
DRY=${DRY:-}
if [ -z "$DRY" ] && ! command -v nvidia-smi > /dev/null; then DRY=1; fi
# NVLink multicast stays off on the shared machines (see the device notes)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} CUDA_DEVICE_MAX_CONNECTIONS=1
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
# one Triton cache for every run of the call (runs of the same shapes compile once)
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$WORK/triton}

if [ -n "$DRY" ]; then
  echo "gpu_multi.sh: DRY run on the CPU (tiny models, gloo)"
  MIN_RUN=${DRY_MIN_RUN:-10}
  MAX_DOCS=${MAX_DOCS:-200}
  GPT_TINY="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --kv-channels 16
    --ffn-hidden-size 128 --seq-length 64 --max-position-embeddings 64 --no-bf16 --num-workers 0
    --no-overlap-grad-reduce --no-overlap-param-gather --log-interval 1"
  HYB_TINY="--hybrid-override-pattern M*EM*E --num-layers 6 --hidden-size 64
    --num-attention-heads 8 --num-query-groups 2 --kv-channels 16 --ffn-hidden-size 64
    --mamba-num-heads 8 --mamba-head-dim 16 --mamba-state-dim 16 --mamba-num-groups 4
    --mamba-impl pytorch --no-disable-mamba-mem-eff-path --num-experts 4 --moe-ffn-hidden-size 32
    --moe-shared-expert-intermediate-size 64 --moe-router-topk 2 --seq-length 64 --no-bf16
    --num-workers 0 --log-interval 1"
  # enough iterations after the first checkpoint (4) for the kill to land before the end
  TWONODE_ITERS=${TWONODE_ITERS:-40}; TWONODE_SAVE=${TWONODE_SAVE:-4}; KILL_AFTER=${KILL_AFTER:-1}
  TWONODE_MB=${TWONODE_MB:-2}; TWONODE_GBS=${TWONODE_GBS:-8}
  SCALING_ITERS=${SCALING_ITERS:-4}; WARM=${WARM:-1}; MB=${MB:-2}
  HYB_ITERS=${HYB_ITERS:-4}; HYB_SEQ=${HYB_SEQ:-64}
  LONG_SEQ=${LONG_SEQ:-256}; LONG_ITERS=${LONG_ITERS:-3}
else
  GPT_TINY=""; HYB_TINY=""
  nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$OUT/gpu.txt"
fi
EXTRA=${EXTRA:-}

left() { echo $(( CALL_LIMIT - (SECONDS - START) )); }
run_budget() {  # seconds the next run may take: RUN_TIMEOUT, or what the call has left less RESERVE
  local b=$(( $(left) - RESERVE ))
  (( b > RUN_TIMEOUT )) && b=$RUN_TIMEOUT
  echo "$b"
}
can_start() {  # enough of the call left for one more run?
  (( $(run_budget) >= MIN_RUN ))
}
stamp() { echo "[$(date -u +%T) +$(( SECONDS - START ))s] $*"; }

# -- data: data/docs_text_document (preprocessed before the call, carried) or a slice made here
data_prefix() {
  if [ -z "$DRY" ] && [ -f data/docs_text_document.bin ]; then echo data/docs_text_document; return; fi
  local prefix=$WORK/docs corpus=data/docs-corpus.jsonl.xz
  [ -f "$corpus" ] || corpus=../shared/data/docs-corpus.jsonl.xz
  if [ ! -f "${prefix}_text_document.idx" ]; then
    python3 tools/preprocess_data.py --input "$corpus" --output-prefix "$prefix" \
      --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model mistral \
      --workers "$(( $(nproc) > 32 ? 32 : $(nproc) ))" --no-progress \
      ${MAX_DOCS:+--max-documents "$MAX_DOCS"} > "$WORK/preprocess.log" 2>&1 || {
        echo "preprocessing failed: $WORK/preprocess.log" >&2; tail -20 "$WORK/preprocess.log" >&2; exit 1; }
  fi
  echo "${prefix}_text_document"
}

# -- a recipe made into a short run: make_cfg SRC DST key=value ... (values parsed as YAML)
make_cfg() {
  python3 - "$@" <<'PY'
import sys, yaml
src, dst, updates = sys.argv[1], sys.argv[2], sys.argv[3:]
c = yaml.safe_load(open(src))
for k in ("data-path", "data-args-path", "train-data-path", "valid-data-path", "test-data-path",
          "save", "load", "save-interval", "tensorboard-dir", "metrics-file", "train-iters",
          "train-samples", "lr-warmup-samples", "lr-warmup-iters", "lr-decay-samples",
          "lr-decay-iters", "lr-warmup-fraction", "exit-duration-in-mins", "exit-signal-handler",
          "wandb-project", "wandb-exp-name"):
    c.pop(k, None)
c.update({"split": "98,2,0", "eval-interval": 100000, "eval-iters": 1, "num-workers": 2,
          "log-interval": 10})
for u in updates:
    k, v = u.split("=", 1)
    c[k] = yaml.safe_load(v)
c["lr-warmup-iters"] = c.get("lr-warmup-iters") or max(1, c["train-iters"] // 10)
yaml.safe_dump(c, open(dst, "w"), sort_keys=False)
PY
}
asa_src() {  # the ASA recipe and its flags per ASA_SHAPE
  case $ASA_SHAPE in
    tpp) echo "recipes/transformer-pp-1.3b-100b.yaml attention-variant=asa" ;;
    paper) echo "recipes/asa-1.3b-100b.yaml attention-variant=asa" ;;
    *) echo "ASA_SHAPE must be tpp or paper (got $ASA_SHAPE)" >&2; exit 2 ;;
  esac
}
gpu_list() {  # first COUNT: "0,1,...", from offset FROM
  local from=$1 count=$2 i s=""
  for ((i = from; i < from + count; i++)); do s+="${s:+,}$i"; done
  echo "$s"
}

# shared summary helpers (python): per-iteration losses (the last attempt's), attempts, peak memory
PYLIB='
import json, re, os
def attempts(path):
    """the metrics file as a list of attempts: a new one starts where the iteration goes back,
    or at a line count recorded in PATH.splits (the script writes it before a resumed attempt)"""
    out, last = [], None
    if not os.path.exists(path):
        return out
    splits = set(map(int, open(path + ".splits").read().split())) if os.path.exists(path + ".splits") else set()
    for n, line in enumerate(open(path)):
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if "lm_loss" not in r:
            continue
        if last is None or r["iteration"] <= last or n in splits:
            out.append([])
        out[-1].append(r); last = r["iteration"]
    return out
def losses(path):
    d = {}
    for a in attempts(path):
        for r in a:
            if r["lm_loss"] is not None:
                d[r["iteration"]] = r["lm_loss"]
    return d
def rate(recs, warm):
    xs = [r["tokens_per_sec_per_gpu"] for r in recs[warm:]] or [r["tokens_per_sec_per_gpu"] for r in recs]
    return sum(xs) / len(xs) if xs else float("nan")
def peak_mem(*logs):
    m = []
    for log in logs:
        if os.path.exists(log):
            m += [float(x) for x in re.findall(r"peak (?:memory|CPU RSS) \(GB\): ([0-9.]+)", open(log, errors="replace").read())]
    return max(m) if m else float("nan")
def status(log):
    if not os.path.exists(log):
        return "not run"
    t = open(log, errors="replace").read()
    m = re.findall(r"^exit (\d+)", t, re.M)
    if "out of memory" in t or "OutOfMemoryError" in t:
        return "OOM"
    return "ok" if m and m[-1] == "0" else ("timeout" if m and m[-1] in ("124", "137") else f"exit {m[-1]}" if m else "?")
def diff_table(a, b, every):
    its = sorted(set(a) & set(b))
    if not its:
        return ["no common iterations"], None
    d = {i: abs(a[i] - b[i]) for i in its}
    worst = max(its, key=d.get)
    rows = ["| iteration | loss A | loss B | abs diff |", "|---|---|---|---|"]
    rows += [f"| {i} | {a[i]:.4f} | {b[i]:.4f} | {d[i]:.4f} |" for i in its
             if i == its[0] or i % every == 0 or i == its[-1] or i == worst]
    return rows, (len(its), d[worst], worst, sum(d.values()) / len(its))
'

# ----------------------------------------------------------------------------------- twonode
TW_PIDS=""
submit() {  # NAME JOB_ID ATTEMPT [trainer flags]: train.sbatch as Slurm would start it; sets SUBMIT_PID
  local name=$1 id=$2 attempt=$3; shift 3
  local gpn=$(( NGPU / 2 ))
  stamp "twonode: sbatch $name (job $id, attempt $attempt)" | tee -a "$TL/$name.attempt$attempt.out"
  env PATH="$R/tests/data/fake_slurm:$PATH" SLURM_JOB_ID="$id" SLURM_JOB_NUM_NODES=2 \
    SLURM_JOB_NODELIST="node[1-2]" SLURM_SUBMIT_DIR="$R" SLURM_RESTART_COUNT="$attempt" \
    SUBQ_GPUS_PER_NODE="$gpn" SUBQ_PYTHON=python3 SUBQ_GPU="${SUBQ_GPU:-H100}" \
    MASTER_PORT=$(( PORT + 10 + attempt + (id % 10) * 3 )) OMP_NUM_THREADS="$OMP_NUM_THREADS" \
    FAKE_SRUN_PIDS="$TD/$name.pids" FAKE_REQUEUED="$TD/$name.requeued" \
    FAKE_SRUN_NODE_GPUS="$(gpu_list 0 "$gpn") $(gpu_list "$gpn" "$gpn")" \
    setsid bash recipes/slurm/train.sbatch "$TD/twonode.yaml" --save "$TD/$name" \
    --metrics-file "$TD/$name.jsonl" "$@" >> "$TL/$name.attempt$attempt.out" 2>&1 &
  SUBMIT_PID=$!
  TW_PIDS="$TD/$name.pids"
}
kill_job() {  # the sbatch script's group and every "node" (each in its own session)
  local p
  if [ -f "$TW_PIDS" ]; then
    for p in $(awk '{print $2}' "$TW_PIDS"); do kill -KILL -- "-$p" 2> /dev/null; done
  fi
  kill -KILL -- "-$1" 2> /dev/null
}
wait_job() {  # PID DEADLINE(seconds since START): the sbatch's exit status, 124 when stopped at the deadline
  local pid=$1 deadline=$2
  while kill -0 "$pid" 2> /dev/null; do
    if (( SECONDS - START > deadline )); then
      stamp "twonode: call budget reached, stopping the job" >&2
      kill_job "$pid"; wait "$pid" 2> /dev/null; return 124
    fi
    sleep 1
  done
  wait "$pid"
}
last_iter() { [ -f "$1" ] && tail -1 "$1" | python3 -c "import json,sys; print(json.loads(sys.stdin.read() or '{}').get('iteration', 0))" 2> /dev/null || echo 0; }

stage_twonode() {
  TD=$WORK/twonode; TL=$WORK/logs/twonode
  rm -rf "$TD" "$TL"; mkdir -p "$TD" "$TL"
  local iters=${TWONODE_ITERS:-200}
  local save_every=${TWONODE_SAVE:-$(( iters / 2 ))} kill_after=${KILL_AFTER:-10}
  local mb=${TWONODE_MB:-4} gbs=${TWONODE_GBS:-16} data src
  data=$(data_prefix) || return 1
  # shellcheck disable=SC2046
  set -- $(asa_src)
  src=$1; shift
  [ "$ASA_SHAPE" = paper ] && mb=${TWONODE_MB:-2}
  make_cfg "$src" "$TD/twonode.yaml" "$@" "data-path=[$data]" "train-iters=$iters" \
    "micro-batch-size=$mb" "global-batch-size=$gbs" "tensor-model-parallel-size=2" \
    "sequence-parallel=true" "save-interval=$save_every" "exit-signal-handler=true" \
    "lr-warmup-iters=$(( iters / 10 > 0 ? iters / 10 : 1 ))" "seed=1234" "eval-iters=0" || return 1
  # tiny overrides (dry) and EXTRA go after the recipe: the same for A and B
  # (the optimizer state is saved fully reshardable, the default: --no-dist-ckpt-optim-fully-
  # reshardable's per-rank buffers failed to load at TP 2 x DP 2 in the CPU dry run)
  local flags=($GPT_TINY $EXTRA)
  echo "twonode: $src (${*}), TP 2 (+SP) x DP 2 over 2 \"nodes\" of $(( NGPU / 2 )) GPUs, $iters iterations" \
       "of $gbs x seq, checkpoint every $save_every, B's node 1 killed $kill_after iterations after it" | tee "$TL/plan.txt"
  cp "$TD/twonode.yaml" "$TL/"

  # A: uninterrupted (saves only at the end, model only: the comparison needs no resumable A).
  # TWONODE_A=FILE takes A's metrics from an earlier call instead (the same recipe, seed and
  # layout: A and B were bitwise equal up to the kill in the call that made docs/runs/gpu_multi)
  local t0=$SECONDS rc
  if [ -n "${TWONODE_A:-}" ]; then
    [ -f "$TWONODE_A" ] || { echo "TWONODE_A=$TWONODE_A: no such file" >&2; return 2; }
    cp "$TWONODE_A" "$TD/a.jsonl"
    echo "A: not run; its metrics are $TWONODE_A (an earlier call)" | tee "$TL/a.wall"
  else
    can_start || { stamp "twonode: no time left for A"; return 1; }
    submit a 9101 0 "${flags[@]}" --save-interval 1000000 --no-save-optim --no-save-rng
    wait_job "$SUBMIT_PID" $(( CALL_LIMIT - RESERVE )); rc=$?
    echo "A: exit $rc, wall $(( SECONDS - t0 )) s" | tee "$TL/a.wall"
  fi

  # B: node 1 killed KILL_AFTER iterations after the first complete checkpoint
  t0=$SECONDS
  can_start || { stamp "twonode: no time left for B"; return 1; }
  submit b 9202 0 "${flags[@]}"
  local pid=$SUBMIT_PID ck="" tracker=$TD/b/latest_checkpointed_iteration.txt
  while kill -0 "$pid" 2> /dev/null && (( SECONDS - START < CALL_LIMIT - RESERVE )); do
    if [ -z "$ck" ] && [ -f "$tracker" ]; then ck=$(tr -dc 0-9 < "$tracker"); stamp "twonode: B checkpoint at $ck"; fi
    if [ -n "$ck" ] && (( $(last_iter "$TD/b.jsonl") >= ck + kill_after )); then
      local node1
      node1=$(awk '$1 == 1 {p = $2} END {print p}' "$TD/b.pids")
      stamp "twonode: killing \"node\" 1 (process group $node1) at iteration $(last_iter "$TD/b.jsonl")" | tee "$TL/b.kill"
      kill -KILL -- "-$node1"
      break
    fi
    sleep 0.5
  done
  wait_job "$pid" $(( CALL_LIMIT - RESERVE )); rc=$?
  echo "B attempt 0: exit $rc (non-zero expected), wall $(( SECONDS - t0 )) s, requeued: $(cat "$TD/b.requeued" 2> /dev/null)" | tee "$TL/b.wall"
  if [ -f "$TD/b.requeued" ] && can_start; then
    local t1=$SECONDS
    wc -l < "$TD/b.jsonl" >> "$TD/b.jsonl.splits"
    submit b 9202 1 "${flags[@]}"
    wait_job "$SUBMIT_PID" $(( CALL_LIMIT - RESERVE )); rc=$?
    echo "B attempt 1: exit $rc, wall $(( SECONDS - t1 )) s; B total $(( SECONDS - t0 )) s" | tee -a "$TL/b.wall"
  else
    echo "B: not requeued or no time left: no resume" | tee -a "$TL/b.wall"
  fi
}
summary_twonode() {
  TD=$WORK/twonode; TL=$WORK/logs/twonode
  [ -d "$TD" ] || return 0
  cp "$TD"/*.jsonl* "$TL/" 2> /dev/null
  local n; for n in a b; do [ -d "$TD/$n/logs" ] && cp -r "$TD/$n/logs" "$TL/$n-node-logs"; done
  python3 - "$TD" "$TL" "${WARM:-10}" "$NGPU" <<PY > "$OUT/twonode.md"
$PYLIB
import glob, sys
td, tl, warm, ngpu = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
print("## twonode: train.sbatch, 2 \"nodes\" x %d GPUs, TP 2 x DP 2; B killed and resumed\n" % (ngpu // 2))
print(open(f"{tl}/plan.txt").read())
for f in ("a.wall", "b.kill", "b.wall"):
    if os.path.exists(f"{tl}/{f}"):
        print("    " + open(f"{tl}/{f}").read().strip().replace("\n", "\n    "))
print()
a, b = losses(f"{td}/a.jsonl"), losses(f"{td}/b.jsonl")
ck = None
for log in sorted(glob.glob(f"{td}/b/logs/*/node0.attempt1.log")):
    m = re.search(r"loaded checkpoint at iteration (\d+)", open(log, errors="replace").read())
    ck = int(m.group(1)) if m else None
b_att = attempts(f"{td}/b.jsonl")
iters = max(a) if a else None
killed = len(b_att) > 1 or (b_att and b_att[0][-1]["iteration"] < (iters or 0))
print(f"B's first attempt ended at iteration {b_att[0][-1]['iteration'] if b_att else None} of {iters}"
      f" ({'interrupted' if killed else 'NOT interrupted: the kill came too late'}); its second"
      f" attempt loaded the checkpoint at iteration {ck}.\n")
print("| run | attempt | iterations | tokens/s/GPU (after %d) | tokens/s (x%d GPUs) | peak mem/GPU (GB) |" % (warm, ngpu))
print("|---|---|---|---|---|---|")
for name in ("a", "b"):
    for i, att in enumerate(attempts(f"{td}/{name}.jsonl")):
        r = rate(att, warm)
        logs = glob.glob(f"{td}/{name}/logs/*/node*.attempt{i}.log")
        print(f"| {name.upper()} | {i} | {att[0]['iteration']}-{att[-1]['iteration']} | {r:,.0f} | {r * ngpu:,.0f} | {peak_mem(*logs):.1f} |")
rows, st = diff_table(a, b, 20)
print()
if st:
    n, worst, at, mean = st
    print(f"A vs B, loss per iteration: {n} common iterations (A {len(a)}, B {len(b)}); max abs diff {worst:.2e} (iteration {at}), mean {mean:.2e}")
    if ck:
        for lo, hi, what in ((1, ck, "before the kill (same process history)"), (ck + 1, 10**9, "after the resume")):
            d = [abs(a[i] - b[i]) for i in a if lo <= i <= hi and i in b]
            if d:
                print(f"- {what}: {len(d)} iterations, max abs diff {max(d):.2e}, mean {sum(d) / len(d):.2e}")
    print()
print("\n".join(rows))
PY
  cat "$OUT/twonode.md"
}

# ----------------------------------------------------------------------------------- scaling
SC_PIDS=()
launch() {  # NAME NPROC GPUS CFG PORT [flags]: torchrun in the background, log $SL/NAME.log
  local name=$1 nproc=$2 gpus=$3 cfg=$4 port=$5; shift 5
  local budget; budget=$(run_budget)
  local cmd=(timeout -k 20 "$budget" python3 -m torch.distributed.run --nproc-per-node "$nproc"
             --master-port "$port" "$ENTRY" --config "$cfg" "$@")
  stamp "$name on GPUs $gpus (limit ${budget}s)"
  echo "\$ CUDA_VISIBLE_DEVICES=$gpus ${cmd[*]}" > "$SL/$name.log"
  ( CUDA_VISIBLE_DEVICES=$gpus "${cmd[@]}" >> "$SL/$name.log" 2>&1; echo "exit $?" >> "$SL/$name.log" ) &
  SC_PIDS+=($!)
}
stage_scaling() {
  SD=$WORK/scaling; SL=$WORK/logs/scaling; ENTRY=examples/pretrain_gpt.py
  rm -rf "$SD" "$SL"; mkdir -p "$SD" "$SL"
  local iters=${SCALING_ITERS:-30} mb=${MB:-8} data spec model layout tp dp n asa
  [ "$ASA_SHAPE" = paper ] && [ -z "$DRY" ] && mb=${MB:-4}
  data=$(data_prefix) || return 1
  local runs=(${SCALING_RUNS:-tpp_dp1 asa_dp1 tpp_dp2 asa_dp2 tpp_dp4 asa_dp4 tpp_tp2dp2 asa_tp2dp2})
  asa=$(asa_src) || return 1
  echo "scaling: ${runs[*]}; $iters iterations, micro-batch $mb per DP rank, global batch $mb x GPUs;" \
       "asa = $asa" | tee "$SL/plan.txt"
  # batches of runs that fit the host side by side (SERIAL=1: one run per batch)
  local batch=() used=0 i=0
  flush() {
    (( ${#batch[@]} )) || return 0
    SC_PIDS=()
    local off=0 b
    for b in "${batch[@]}"; do
      set -- $b   # name n tp cfg
      if can_start; then
        launch "$1" "$2" "$(gpu_list "$off" "$2")" "$4" $(( PORT + 20 + i )) $GPT_TINY $EXTRA \
          --tensor-model-parallel-size "$3" $([ "$3" -gt 1 ] && echo --sequence-parallel) \
          --metrics-file "$SD/$1.jsonl"
      else
        stamp "$1: skipped (call budget)"; echo "exit skipped (call budget)" > "$SL/$1.log"
      fi
      off=$(( off + $2 )); i=$(( i + 1 ))
    done
    wait "${SC_PIDS[@]}" 2> /dev/null
    batch=(); used=0
  }
  for spec in "${runs[@]}"; do
    model=${spec%%_*}; layout=${spec#*_}
    case $layout in dp*) tp=1; dp=${layout#dp} ;; tp2dp*) tp=2; dp=${layout#tp2dp} ;;
      *) echo "unknown layout $layout (dpN, tp2dpN)" >&2; return 2 ;; esac
    n=$(( tp * dp ))
    (( n <= NGPU )) || { echo "$spec: $n GPUs > NGPU=$NGPU, skipped"; continue; }
    local cfg=$SD/$spec.yaml
    if [ "$model" = tpp ]; then
      make_cfg recipes/transformer-pp-1.3b-100b.yaml "$cfg" "data-path=[$data]" "train-iters=$iters" \
        "micro-batch-size=$mb" "global-batch-size=$(( mb * n ))" || return 1
    elif [ "$model" = asa ]; then
      make_cfg "${asa%% *}" "$cfg" "${asa#* }" "data-path=[$data]" "train-iters=$iters" \
        "micro-batch-size=$mb" "global-batch-size=$(( mb * n ))" || return 1
    else
      echo "unknown model $model (tpp, asa)" >&2; return 2
    fi
    if [ -n "${SERIAL:-}" ] || (( used + n > NGPU )); then flush; fi
    batch+=("$spec $n $tp $cfg"); used=$(( used + n ))
  done
  flush
}
summary_dirs() {  # SD, SL of stage $1, its metrics and configs copied beside the logs; 1: not run
  SD=$WORK/$1; SL=$WORK/logs/$1
  [ -d "$SD" ] || return 1
  cp "$SD"/*.jsonl "$SD"/*.yaml "$SL/" 2> /dev/null
  return 0
}
summary_scaling() {
  summary_dirs scaling || return 0
  python3 - "$SD" "$SL" "${WARM:-10}" <<PY > "$OUT/scaling.md"
$PYLIB
import sys
sd, sl, warm = sys.argv[1], sys.argv[2], int(sys.argv[3])
print("## scaling: weak scaling, the same tokens per GPU per iteration\n")
print(open(f"{sl}/plan.txt").read())
import glob
names = sorted((os.path.basename(p)[:-4] for p in glob.glob(f"{sl}/*.log")),
               key=lambda s: (s.split("_")[0] != "tpp", "tp2" in s, len(s), s))
base = {}
print("| run | GPUs | status | iterations | tokens/s/GPU (after %d) | tokens/s total | efficiency vs 1 GPU | peak mem/GPU (GB) |" % warm)
print("|---|---|---|---|---|---|---|---|")
for name in names:
    model, layout = name.split("_", 1)
    tp = 2 if layout.startswith("tp2") else 1
    n = tp * int(layout.split("dp")[-1])
    att = attempts(f"{sd}/{name}.jsonl")
    recs = att[-1] if att else []
    r = rate(recs, warm) if recs else float("nan")
    if n == 1 and recs:
        base[model] = r
    eff = f"{100 * r / base[model]:.1f}%" if model in base and recs else "-"
    print(f"| {name} | {n} | {status(f'{sl}/{name}.log')} | {len(recs)} | {r:,.0f} | {r * n:,.0f} | {eff} | {peak_mem(f'{sl}/{name}.log'):.1f} |")
PY
  cat "$OUT/scaling.md"
}

# ------------------------------------------------------------------------------------ hybrid
stage_hybrid() {
  SD=$WORK/hybrid; SL=$WORK/logs/hybrid; ENTRY=examples/pretrain_hybrid.py
  rm -rf "$SD" "$SL"; mkdir -p "$SD" "$SL"
  local iters=${HYB_ITERS:-50} data
  data=$(data_prefix) || return 1
  # tools/gpu_hybrid.sh's Nano-width hybrid (12 layers, 16 experts), superlinear in the '*' slots
  cat > "$SD/hybrid.yaml" <<EOF
hybrid-override-pattern: "MEMEM*EMEM*E"
num-layers: 12
hidden-size: 2688
num-attention-heads: 32
num-query-groups: 2
kv-channels: 128
ffn-hidden-size: 1856
mamba-num-heads: 64
mamba-head-dim: 64
mamba-state-dim: 128
mamba-num-groups: 8
mamba-impl: megatron
disable-mamba-mem-eff-path: true
num-experts: 16
moe-ffn-hidden-size: 1856
moe-shared-expert-intermediate-size: 3712
moe-router-topk: 6
moe-router-score-function: sigmoid
moe-router-enable-expert-bias: true
moe-router-topk-scaling-factor: 2.5
moe-router-dtype: fp32
moe-router-load-balancing-type: seq_aux_loss
moe-aux-loss-coeff: 1.0e-4
squared-relu: true
position-embedding-type: none
init-method-std: 0.0173
attention-variant: superlinear
seq-length: ${HYB_SEQ:-4096}
micro-batch-size: 2
global-batch-size: 8
train-iters: $iters
lr: 6.0e-4
min-lr: 6.0e-5
lr-decay-style: cosine
lr-warmup-iters: $(( iters / 10 > 0 ? iters / 10 : 1 ))
weight-decay: 0.1
clip-grad: 1.0
bf16: true
data-path: [$data]
split: "98,2,0"
tokenizer-type: GPTSentencePieceTokenizer
tokenizer-model: mistral
num-workers: 2
seed: 1234
log-interval: 10
eval-interval: 100000
eval-iters: 1
EOF
  echo "hybrid: Nano-width 12-layer hybrid, superlinear slots, $iters iterations of 8 x ${HYB_SEQ:-4096};" \
       "1 GPU vs TP 2 + SP, EP 2 (expert TP 2), CP 2 on $NGPU" | tee "$SL/plan.txt"
  # One set of initial weights for both layouts: the trainer draws them per layout (expert
  # weights differ under EP: the CPU dry run's first losses differed by 0.009 in fp32), so a
  # 1-GPU launch saves its initial model (1 iteration at LR 0 without the expert-bias update:
  # the weights stay as drawn) and both runs start from it with --finetune (weights only; the
  # torch_dist checkpoint reshards to TP 2 / EP 2 on load).
  can_start || { stamp "hyb_init: skipped (call budget)"; return 1; }
  SC_PIDS=()
  launch hyb_init 1 0 "$SD/hybrid.yaml" $(( PORT + 39 )) $HYB_TINY $EXTRA --train-iters 1 \
    --lr 0 --min-lr 0 --lr-warmup-iters 0 --moe-router-bias-update-rate 0 --eval-iters 0 \
    --save "$SD/init" --no-save-optim --no-save-rng
  wait "${SC_PIDS[@]}" 2> /dev/null
  [ -f "$SD/init/latest_checkpointed_iteration.txt" ] || { stamp "hyb_init: no checkpoint"; return 1; }
  # the runs: hyb_1gpu (A), hyb_1gpu_mb1 (the bf16-noise control: A's math at micro-batch 1, so
  # only the summation grouping differs; beside A on GPU 1) and hyb_tp2sp_ep2_cp2 (B, all GPUs).
  # HYB_REF=DIR adds an earlier call's metrics (DIR/<run>.jsonl) as ref_<run> to the comparison.
  local runs=" ${HYB_RUNS:-hyb_1gpu hyb_1gpu_mb1 hyb_tp2sp_ep2_cp2} " r
  if [ -n "${HYB_REF:-}" ]; then
    for r in hyb_1gpu hyb_1gpu_mb1 hyb_tp2sp_ep2_cp2; do
      [ -f "$HYB_REF/$r.jsonl" ] && cp "$HYB_REF/$r.jsonl" "$SD/ref_$r.jsonl"
    done
  fi
  SC_PIDS=()
  local gpu=0
  for r in hyb_1gpu hyb_1gpu_mb1; do
    [[ $runs == *" $r "* ]] || continue
    can_start || { stamp "$r: skipped (call budget)"; echo "exit skipped (call budget)" > "$SL/$r.log"; continue; }
    launch "$r" 1 "$gpu" "$SD/hybrid.yaml" $(( PORT + 40 + gpu )) $HYB_TINY $EXTRA \
      $([ "$r" = hyb_1gpu_mb1 ] && echo --micro-batch-size 1) \
      --load "$SD/init" --finetune --metrics-file "$SD/$r.jsonl"
    gpu=$(( gpu + 1 ))
  done
  wait "${SC_PIDS[@]}" 2> /dev/null
  r=hyb_tp2sp_ep2_cp2
  if [[ $runs == *" $r "* ]]; then
    if can_start; then
      SC_PIDS=()
      launch "$r" "$NGPU" "$(gpu_list 0 "$NGPU")" "$SD/hybrid.yaml" $(( PORT + 42 )) $HYB_TINY $EXTRA \
        --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 \
        --context-parallel-size 2 --load "$SD/init" --finetune --metrics-file "$SD/$r.jsonl"
      wait "${SC_PIDS[@]}" 2> /dev/null
    else
      stamp "$r: skipped (call budget)"; echo "exit skipped (call budget)" > "$SL/$r.log"
    fi
  fi
}
summary_hybrid() {
  summary_dirs hybrid || return 0
  python3 - "$SD" "$SL" "${WARM:-10}" <<PY > "$OUT/hybrid.md"
$PYLIB
import sys
sd, sl, warm = sys.argv[1], sys.argv[2], int(sys.argv[3])
print("## hybrid: the Nano-width hybrid (superlinear slots), 1 GPU vs TP 2 + SP, EP 2, CP 2\n")
print(open(f"{sl}/plan.txt").read())
print("| run | status | iterations | tokens/s/GPU (after %d) | peak mem/GPU (GB) |" % warm)
print("|---|---|---|---|---|")
names = ("hyb_1gpu", "hyb_1gpu_mb1", "hyb_tp2sp_ep2_cp2")
print(f"| hyb_init (initial weights, 1 iteration at LR 0) | {status(f'{sl}/hyb_init.log')} | | | |")
for name in names + tuple("ref_" + n for n in names):
    att = attempts(f"{sd}/{name}.jsonl"); recs = att[-1] if att else []
    if name.startswith("ref_") and not recs:
        continue
    st = "earlier call" if name.startswith("ref_") else status(f"{sl}/{name}.log")
    print(f"| {name} | {st} | {len(recs)} | {rate(recs, warm) if recs else float('nan'):,.0f} | {peak_mem(f'{sl}/{name}.log'):.1f} |")
a = losses(f"{sd}/hyb_1gpu.jsonl") or losses(f"{sd}/ref_hyb_1gpu.jsonl")
pairs = (("hyb_tp2sp_ep2_cp2", "B = TP 2 + SP, EP 2, CP 2 on 4 GPUs"),
         ("hyb_1gpu_mb1", "the control: 1 GPU at micro-batch 1 (bf16 noise)"),
         ("ref_hyb_1gpu", "A of an earlier call (reproducibility)"),
         ("ref_hyb_tp2sp_ep2_cp2", "B of an earlier call"),
         ("ref_hyb_1gpu_mb1", "the control of an earlier call"))
for name, what in pairs:
    b = losses(f"{sd}/{name}.jsonl")
    if not (a and b):
        continue
    rows, st = diff_table(a, b, 5)
    print()
    if st:
        n, worst, at, mean = st
        signed = [b[i] - a[i] for i in sorted(set(a) & set(b))]
        print(f"Loss per iteration, A = 1 GPU vs {what}: {n} iterations, max abs diff {worst:.2e}"
              f" (iteration {at}), mean abs {mean:.2e}, mean signed (B - A) {sum(signed) / len(signed):+.2e}\n")
    print("\n".join(rows))
PY
  cat "$OUT/hybrid.md"
}

# ----------------------------------------------------------------------------------- longctx
stage_longctx() {
  SD=$WORK/longctx; SL=$WORK/logs/longctx; ENTRY=examples/pretrain_gpt.py
  rm -rf "$SD" "$SL"; mkdir -p "$SD" "$SL"
  local seq=${LONG_SEQ:-131072} iters=${LONG_ITERS:-8} data spec variant cp src
  data=$(data_prefix) || return 1
  echo "longctx: GPT 1.3B at $seq tokens, CP = $NGPU, full recompute, micro-batch 1, $iters iterations;" \
       "ASA_SHAPE=$ASA_SHAPE" | tee "$SL/plan.txt"
  for spec in ${LONG_RUNS:-asa_cp4 superlinear_cp4 standard_cp4}; do
    variant=${spec%_cp*}; cp=${spec##*_cp}
    (( cp <= NGPU )) || { echo "$spec: CP $cp > NGPU=$NGPU, skipped"; continue; }
    src=recipes/transformer-pp-1.3b-100b.yaml
    [ "$variant" = asa ] && [ "$ASA_SHAPE" = paper ] && src=recipes/asa-1.3b-100b.yaml
    make_cfg "$src" "$SD/$spec.yaml" "attention-variant=$variant" "data-path=[$data]" \
      "train-iters=$iters" "micro-batch-size=1" "global-batch-size=$(( NGPU / cp ))" \
      "seq-length=$seq" "max-position-embeddings=$seq" "recompute-activations=false" \
      "recompute-granularity=full" "recompute-method=uniform" "recompute-num-layers=1" \
      "log-interval=1" "lr-warmup-iters=2" || return 1
    can_start || { stamp "$spec: skipped (call budget)"; echo "exit skipped (call budget)" > "$SL/$spec.log"; continue; }
    SC_PIDS=()
    local tiny=$GPT_TINY
    [ -n "$DRY" ] && tiny="${GPT_TINY//--seq-length 64 --max-position-embeddings 64/}"
    launch "$spec" "$NGPU" "$(gpu_list 0 "$NGPU")" "$SD/$spec.yaml" $(( PORT + 50 )) $tiny $EXTRA \
      --context-parallel-size "$cp" --metrics-file "$SD/$spec.jsonl"
    wait "${SC_PIDS[@]}" 2> /dev/null
  done
}
summary_longctx() {
  summary_dirs longctx || return 0
  python3 - "$SD" "$SL" <<PY > "$OUT/longctx.md"
$PYLIB
import glob, sys
sd, sl = sys.argv[1], sys.argv[2]
warm = 2
print("## longctx: GPT 1.3B, context parallelism\n")
print(open(f"{sl}/plan.txt").read())
print("| run | status | iterations | s/iteration (after %d) | tokens/s/GPU | peak mem/GPU (GB) | last loss |" % warm)
print("|---|---|---|---|---|---|---|")
for log in sorted(glob.glob(f"{sl}/*.log")):
    name = os.path.basename(log)[:-4]
    att = attempts(f"{sd}/{name}.jsonl"); recs = att[-1] if att else []
    t = [r["time_s"] for r in recs[warm:]] or [r["time_s"] for r in recs]
    sec = sum(t) / len(t) if t else float("nan")
    last = f"{recs[-1]['lm_loss']:.3f}" if recs else "-"
    print(f"| {name} | {status(log)} | {len(recs)} | {sec:.2f} | {rate(recs, warm) if recs else float('nan'):,.0f} | {peak_mem(log):.1f} | {last} |")
PY
  cat "$OUT/longctx.md"
}

# ------------------------------------------------------------------------------------- main
STAGES=("$@")
[ ${#STAGES[@]} -gt 0 ] || STAGES=(twonode scaling hybrid longctx)
for s in "${STAGES[@]}"; do
  case $s in twonode|scaling|hybrid|longctx) ;; *) echo "unknown stage $s (twonode scaling hybrid longctx)" >&2; exit 2 ;; esac
done
status=0
for s in "${STAGES[@]}"; do
  stamp "== stage $s ($(left) s of the call left)"
  "stage_$s" || status=1
  "summary_$s" || status=1
  mkdir -p "$WORK/logs/$s"
  tar -czf "$OUT/$s-logs.tgz" -C "$WORK/logs/$s" . || status=1
  stamp "== stage $s done: $OUT/$s.md, $OUT/$s-logs.tgz"
done
exit $status
