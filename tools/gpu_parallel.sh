#!/usr/bin/env bash
# Several independent single-GPU jobs at once on the GPUs of one host (device kinds nvidia-h100-x2 /
# -x4, or one GPU shared), in one device call, and everything brought back in two files.
#
#   bash tools/gpu_parallel.sh 'NAME::COMMAND' ['NAME::COMMAND' ...] [-f JOBS_FILE]
#
# Each job is `bash -c COMMAND` from the project root: quotes, pipes, `;` and env assignments
# (`GPU_FILES=asa_kernel bash tools/gpu_kernel_suite.sh gpu-tests`) work as typed. Single-quote
# each spec so that $JOB_OUT is expanded by the job, not by the shell that calls this script.
# JOBS_FILE: one spec per line ('#' lines and blank lines skipped). NAME: letters, digits, '.',
# '_', '-' (it names the job's log and folder). Everything is checked before anything runs: no
# jobs, a spec without '::', a bad or repeated name, an unknown GPU count, a spent CALL_LIMIT are
# refused (exit 2) naming the argument. DRY=1: check and print the plan, run nothing.
#
# Job i (from 0) runs on GPU i mod N (CUDA_VISIBLE_DEVICES=that index), N from `nvidia-smi -L`
# or the environment's GPUS (a count; needed where nvidia-smi is missing, e.g. this CPU machine).
# Each job sees JOB_NAME, JOB_GPU, JOB_OUT (its own empty folder: write result files there),
# OUT=$JOB_OUT (so the device scripts that write to $OUT, gpu_kernel_suite.sh, gpu_train_bench.sh,
# work unchanged inside a job and never add files to the call's $OUT), PYTHONUNBUFFERED=1,
# TRITON_CACHE_DIR (below), and CALL_T0 / CALL_LIMIT set so that a script honouring them (gpu_multi.sh)
# ends before this script stops the jobs; JOB_DEADLINE is that moment in epoch seconds.
# stdout and stderr go to logs/NAME.log. The jobs share the checkout: they must write only under
# $JOB_OUT or temporary folders (no TCACHE_NEW_ONLY inside a job: it deletes cache entries
# the other jobs are using; it is unset for them).
#
# The call's clock: CALL_LIMIT (570 s) from CALL_T0 (epoch seconds, `export CALL_T0=$(date +%s)`
# first thing in the device command, wheels' install included) or this script's start. RESERVE
# (45 s) before that, every job still running is stopped: SIGINT first (pytest prints the summary
# of what ran; Python programs get KeyboardInterrupt), SIGTERM INT_GRACE (20 s) later, SIGKILL
# TERM_GRACE (5 s) after that; then the results are packed, so a call always brings back its
# partial results. The signals go to every process of the job (its own session, made for it, and
# its descendants), except that SIGINT spares the plumbing: shells (told of a SIGINT, bash stops
# its script as soon as the interrupted child returns, skipping the script's own packing), timeout
# (it forwards what it gets: a second SIGINT can cut pytest's summary short) and tee (its death
# would SIGPIPE the writer while it prints its summary). Run scripts as `bash script.sh`.
#
# pytest jobs: use `python3 -m pytest -v -p no:cacheprovider ...`: -v prints one line per test as
# it ends (PYTHONUNBUFFERED=1 is set: nothing is held back), so a job stopped at the deadline still
# shows which tests passed; the summary counts passed / failed / errors / skipped and not run (of
# the selected) from the log. Add `-rA` for the short test summary. (An earlier call's
# `timeout 360 python -m pytest -q ... > file` came back empty: -q prints nothing per test, and
# timeout's SIGTERM stops Python before its summary.)
#
# Triton's compile cache: ONE folder for every job, $R/.tcache (the path gpu_kernel_suite.sh and
# gpu_train_bench.sh use), not one per job, because
#  - concurrent writers are safe: Triton's FileCacheManager.put writes each file into a private
#    tmp.pid_<pid>_<uuid>/ folder and os.replace()s it into place (atomic on POSIX), and a kernel's
#    group index (__grp__*.json) is written after its files: another process sees either no entry
#    (and compiles the kernel itself; both write the same bytes, the last rename wins) or a whole one;
#  - the group index records its files' absolute paths: a carried cache hits only where it was
#    built, $R/.tcache; per-job folders would miss every carried entry and compile each kernel once
#    per job.
# Carried parts (.tcache.tgz.a*, from gpu_kernel_suite.sh or TCACHE_OUT=1) are unpacked there once,
# then moved aside while the jobs run (so that scripts which unpack them themselves do not rewrite
# files other jobs are reading) and put back at the end.
#
# Back in $OUT (a call returns at most 8 files, 16 MiB each, 64 MiB together):
#   results.tgz   logs/NAME.log, out/NAME/... (each job's JOB_OUT), summary.txt; at most
#                 RESULTS_MAX_MB (15) MiB: past that the largest files are left out (logs cut to
#                 their last MiB first), and summary.txt names them; the tcache.tgz.* parts that
#                 gpu_kernel_suite.sh writes into a job's $OUT are left out (the shared cache has them)
#   summary.txt   per job: GPU, status (ok / failed / stopped at the deadline, which signals),
#                 exit status, wall time, pytest counts, the last TAIL_LINES (12) lines of its log;
#                 also printed to stdout at the end (the device tool returns the last 12,000 chars)
#   tcache.tgz.a* TCACHE_OUT=1 only: the shared Triton cache in 15 MiB parts (carry them next call).
#                 At most TCACHE_MAX_PARTS (3; 5 at most: 8 files a call) parts, and no more
#                 than the 64 MiB beside the other two files allow; 3 by default because a call
#                 carries 64 MiB in: the checkout (~8 MB) and .whl (~10.5 MB) leave room for 3
#                 parts. Past that only the entries compiled in this call; if those do not fit
#                 either, none (summary.txt says which; the cache stays on the device machine).
# Unpack here: `mkdir -p /tmp/gp && tar -xzf <files_at>/results.tgz -C /tmp/gp`.
#
# Example (kind nvidia-h100-x4, carry [".whl"] plus any .tcache.tgz.a* parts, timeout_s 600):
#   export CALL_T0=$(date +%s); source .whl/setup.sh && TCACHE_OUT=1 bash tools/gpu_parallel.sh \
#     'cp::python3 tools/bench_cp_layout.py --cp 2 4 --variants asa --json $JOB_OUT/cp.json' \
#     'asa::GPU_FILES=asa_kernel bash tools/gpu_kernel_suite.sh gpu-tests' \
#     'tests::python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_fused.py' \
#     'train::bash tools/gpu_train_bench.sh'
# (docs/benchmarks.md, "Several single-GPU jobs in one call", has the full command.)
# On this CPU machine: GPUS=2 OUT=/tmp/gp bash tools/gpu_parallel.sh 'a::echo $CUDA_VISIBLE_DEVICES'
# (tests/test_gpu_parallel.py runs it so).
#
# Knobs: GPUS, CALL_T0, CALL_LIMIT (570), RESERVE (45), INT_GRACE (20), TERM_GRACE (5), OUT
# (required), WORK (a new /tmp/gpu_parallel.* folder), TAIL_LINES (12), RESULTS_MAX_MB (15),
# TCACHE_OUT, TCACHE_MAX_PARTS (3), POLL (0.25 s), DRY. Exit status: 0 when every job exited 0,
# 1 otherwise, 2 for bad usage.
set -uo pipefail

die() { echo "gpu_parallel.sh: $*" >&2; exit 2; }
usage="usage: bash tools/gpu_parallel.sh 'NAME::COMMAND' ['NAME::COMMAND' ...] [-f JOBS_FILE]"

# ------------------------------------------------------------------ arguments, checked up front
specs=()
while (( $# )); do
  case $1 in
    -f|--file)
      [ $# -ge 2 ] || die "$1 needs a file name ($usage)"
      [ -f "$2" ] || die "jobs file '$2' ($1): no such file"
      while IFS= read -r line || [ -n "$line" ]; do
        line=${line#"${line%%[![:space:]]*}"}
        case $line in ''|'#'*) continue ;; esac
        specs+=("$line")
      done < "$2"
      shift 2 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    *) specs+=("$1"); shift ;;
  esac
done
(( ${#specs[@]} )) || die "no jobs given ($usage)"

NAMES=(); CMDS=()
for spec in "${specs[@]}"; do
  [[ $spec == *::* ]] || die "job spec '$spec': no '::' between NAME and COMMAND ($usage)"
  name=${spec%%::*}; cmd=${spec#*::}
  name=${name#"${name%%[![:space:]]*}"}; name=${name%"${name##*[![:space:]]}"}
  [[ $name =~ ^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$ ]] ||
    die "job spec '$spec': bad NAME '$name' (letters, digits, '.', '_', '-'; at most 64)"
  [[ $cmd =~ [^[:space:]] ]] || die "job spec '$spec': empty COMMAND"
  for n in "${NAMES[@]}"; do [ "$n" = "$name" ] && die "job spec '$spec': NAME '$name' used twice"; done
  NAMES+=("$name"); CMDS+=("$cmd")
done
NJOBS=${#NAMES[@]}

int_knob() {  # VAR DEFAULT: a non-negative integer or die naming VAR
  local v=${!1:-$2}
  [[ $v =~ ^[0-9]+$ ]] || die "$1='$v': not a whole number of seconds/units"
  printf -v "$1" '%s' "$v"
}
int_knob CALL_LIMIT 570; int_knob RESERVE 45; int_knob INT_GRACE 20; int_knob TERM_GRACE 5
int_knob TAIL_LINES 12; int_knob RESULTS_MAX_MB 15; int_knob TCACHE_MAX_PARTS 3
[[ ${POLL:=0.25} =~ ^[0-9]*\.?[0-9]+$ ]] || die "POLL='$POLL': not a number of seconds"
(( TCACHE_MAX_PARTS <= 5 )) ||
  die "TCACHE_MAX_PARTS=$TCACHE_MAX_PARTS: at most 5 (a call returns 8 files: results.tgz, summary.txt, the parts)"

if [ -n "${GPUS:-}" ]; then
  [[ $GPUS =~ ^[1-9][0-9]*$ ]] || die "GPUS='$GPUS': not a GPU count (a whole number >= 1)"
  NGPU=$GPUS
elif command -v nvidia-smi > /dev/null; then
  NGPU=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU ')
  (( NGPU > 0 )) || die "unknown GPU count: nvidia-smi -L lists no GPU; set GPUS=N"
else
  die "unknown GPU count: no nvidia-smi here; set GPUS=N (e.g. GPUS=2 on the CPU)"
fi

now_ms() {  # epoch milliseconds
  local t=${EPOCHREALTIME:-}; [ -n "$t" ] || t=$(date +%s.%N); t=${t/,/.}
  local f=${t#*.}000; echo $(( ${t%.*} * 1000 + 10#${f:0:3} ))
}
if [ -n "${CALL_T0:-}" ]; then
  [[ $CALL_T0 =~ ^[0-9]+$ ]] || die "CALL_T0='$CALL_T0': not epoch seconds (export CALL_T0=\$(date +%s))"
  T0_MS=$(( CALL_T0 * 1000 ))
else
  T0_MS=$(now_ms)
fi
STOP_MS=$(( T0_MS + (CALL_LIMIT - RESERVE) * 1000 ))   # SIGINT to the jobs still running
(( STOP_MS > $(now_ms) )) ||
  die "CALL_LIMIT=$CALL_LIMIT s from CALL_T0 less RESERVE=$RESERVE s is already past: no time to run"
rel() { local ms=$(( $1 - T0_MS )); printf '+%d.%ds' $(( ms / 1000 )) $(( (ms % 1000) / 100 )); }

if [ -n "${DRY:-}" ]; then
  echo "gpu_parallel.sh (DRY=1: nothing runs): $NJOBS jobs on $NGPU GPUs; SIGINT at $(rel "$STOP_MS")," \
       "SIGTERM $INT_GRACE s later, SIGKILL $TERM_GRACE s after; OUT=${OUT:-(not set)}"
  for ((i = 0; i < NJOBS; i++)); do printf '  %-16s GPU %d  %s\n' "${NAMES[i]}" $(( i % NGPU )) "${CMDS[i]}"; done
  (( NJOBS > NGPU )) && echo "  ($NJOBS jobs > $NGPU GPUs: some share a GPU)"
  exit 0
fi

# ------------------------------------------------------------------ set up
[ -n "${OUT:-}" ] || die "OUT must name the folder whose files come back (the device tool sets it)"
mkdir -p "$OUT" || die "OUT=$OUT: cannot create it"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
R=$PWD
PY=${PYTHON:-python3}
WORK=${WORK:-$(mktemp -d /tmp/gpu_parallel.XXXXXX)}
mkdir -p "$WORK" && WORK=$(cd "$WORK" && pwd)
rm -rf "$WORK/logs" "$WORK/out" "$WORK/summary.txt"
mkdir -p "$WORK/logs" "$WORK/out"
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=$R/.tcache
mkdir -p "$TRITON_CACHE_DIR"
stamp() { echo "[gpu_parallel $(date -u +%T) $(rel "$(now_ms)")] $*"; }

CARRIED=()
if compgen -G ".tcache.tgz.a*" > /dev/null; then
  stamp "unpacking the carried Triton cache ($(cat .tcache.tgz.a* | wc -c) bytes) into .tcache"
  cat .tcache.tgz.a* | tar -xz || stamp "warning: unpacking .tcache.tgz.a* failed (a part missing?)"
  mkdir -p "$WORK/carried"
  for f in .tcache.tgz.a*; do mv "$f" "$WORK/carried/" && CARRIED+=("$f"); done
fi
TC_MARK=$WORK/tcache.mark; : > "$TC_MARK"   # cache entries newer than this: compiled by this call
restore_carried() {
  local f
  for f in "${CARRIED[@]}"; do mv "$WORK/carried/$f" "$R/" 2> /dev/null; done
  CARRIED=()
}

# a job's processes: its session (the launcher makes one per job, sid = its pid) and every
# descendant of its pid (also those that made sessions of their own), as "PID COMM" lines;
# with a second argument, the session alone (the job's pid ended and may be reused)
procs_of() {
  cat /proc/[0-9]*/stat 2> /dev/null | awk -v root="$1" -v only_session="${2:-}" '
    { l = $0; o = index(l, "("); c = 0
      for (i = length(l); i > o; i--) if (substr(l, i, 1) == ")") { c = i; break }
      if (!o || !c) next
      p = substr(l, 1, o - 2) + 0; split(substr(l, c + 2), f, " ")
      name[p] = substr(l, o + 1, c - o - 1); st[p] = f[1]; pp[p] = f[2] + 0; sd[p] = f[4] + 0 }
    END { if (only_session == "") keep[root + 0] = 1
      for (p in sd) if (sd[p] == root + 0) keep[p] = 1
      do { grown = 0; for (p in pp) if (!(p in keep) && ((pp[p] "") in keep)) { keep[p] = 1; grown = 1 } } while (grown)
      for (p in keep) if ((p in name) && st[p] != "Z") print p, name[p] }'
}
signal_job() {  # I SIG [session]: SIG to job I's processes (SIGINT: not to shells, timeout, tee)
  local p c pids=()
  while read -r p c; do
    if [ "$2" = INT ]; then case $c in bash|sh|dash|timeout|tee) continue ;; esac; fi
    pids+=("$p")
  done < <(procs_of "${PID[$1]}" "${3:-}")
  (( ${#pids[@]} )) && kill -s "$2" "${pids[@]}" 2> /dev/null
  return 0
}

# ------------------------------------------------------------------ launch
# The launcher: background commands of a non-interactive shell start with SIGINT ignored, and a
# Python started so would ignore it too (no KeyboardInterrupt): restore the defaults, make the
# job its own session (sid = pid: its processes are found and stopped together), exec bash -c.
LAUNCH='import os, signal, sys
for s in (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM): signal.signal(s, signal.SIG_DFL)
try: os.setsid()
except OSError: pass
os.execvp("bash", ["bash", "-c", sys.argv[1]])'
GPU=(); PID=(); START=(); END=(); RC=(); T_INT=(); T_TERM=(); T_KILL=()
DEADLINE_S=$(( STOP_MS / 1000 ))
# bash reports a killed job ("line N: PID Killed  env ...") on its stderr: to a file, kept in results.tgz
exec 3>&2 2>> "$WORK/gpu_parallel.stderr"
for ((i = 0; i < NJOBS; i++)); do
  name=${NAMES[i]}; GPU[i]=$(( i % NGPU ))
  jo=$WORK/out/$name; log=$WORK/logs/$name.log
  mkdir -p "$jo"
  { echo "# gpu_parallel job $name, GPU ${GPU[i]}, started $(date -u +%FT%TZ) ($(rel "$(now_ms)") on the call's clock)"
    echo "# \$ ${CMDS[i]}"; } > "$log"
  env -u TCACHE_NEW_ONLY CUDA_VISIBLE_DEVICES="${GPU[i]}" JOB_NAME="$name" JOB_GPU="${GPU[i]}" \
    JOB_OUT="$jo" OUT="$jo" JOB_DEADLINE="$DEADLINE_S" CALL_T0=$(( T0_MS / 1000 )) \
    CALL_LIMIT=$(( CALL_LIMIT - RESERVE )) \
    "$PY" -c "$LAUNCH" "${CMDS[i]}" >> "$log" 2>&1 < /dev/null &
  PID[i]=$!; START[i]=$(now_ms); END[i]=""; RC[i]=""; T_INT[i]=""; T_TERM[i]=""; T_KILL[i]=""
  stamp "started $name on GPU ${GPU[i]} (pid ${PID[i]}): ${CMDS[i]}"
done
(( NJOBS > NGPU )) && stamp "$NJOBS jobs on $NGPU GPUs: some share a GPU"
stamp "SIGINT to the jobs still running at $(rel "$STOP_MS")"

# ------------------------------------------------------------------ wait, stop at the deadline
FORCE=""; STOP_WHY="at the deadline"
trap 'FORCE=1' INT TERM HUP
reap() {  # record the jobs that ended; returns 0 while any runs
  local i alive=1
  for ((i = 0; i < NJOBS; i++)); do
    [ -n "${END[i]}" ] && continue
    if ! kill -0 "${PID[i]}" 2> /dev/null; then
      wait "${PID[i]}" 2> /dev/null; RC[i]=$?; END[i]=$(now_ms)
      stamp "${NAMES[i]} ended: exit ${RC[i]}, wall $(( (END[i] - START[i]) / 1000 )) s"
    else
      alive=0
    fi
  done
  return $alive
}
signal_running() {  # SIG ARRAY: signal every running job, noting the time
  local i t
  for ((i = 0; i < NJOBS; i++)); do
    [ -n "${END[i]}" ] && continue
    t=$(now_ms); signal_job "$i" "$1"; printf -v "$2[$i]" '%s' "$t"
    stamp "SIG$1 to ${NAMES[i]}"
  done
}
wait_until() {  # MS: poll until every job ended or the moment passed
  while reap && (( $(now_ms) < $1 )) && [ -z "$FORCE" ]; do sleep "$POLL"; done
}
wait_until "$STOP_MS"
if reap; then
  if [ -n "$FORCE" ]; then
    STOP_WHY="when gpu_parallel.sh was signalled"; INT_GRACE=$(( INT_GRACE < 5 ? INT_GRACE : 5 ))
    stamp "stopped from outside: stopping the jobs now"
  fi
  FORCE=""
  signal_running INT T_INT
  wait_until $(( $(now_ms) + INT_GRACE * 1000 ))
  FORCE=""
  if reap; then signal_running TERM T_TERM; wait_until $(( $(now_ms) + TERM_GRACE * 1000 )); fi
  FORCE=""
  if reap; then signal_running KILL T_KILL; wait_until $(( $(now_ms) + 3000 )); fi
fi
# what a job left behind in its session after its top process ended (background children)
for ((i = 0; i < NJOBS; i++)); do
  if [ -n "$(procs_of "${PID[i]}" session)" ]; then
    stamp "${NAMES[i]}: stopping what it left running"
    signal_job "$i" TERM session; sleep 1; signal_job "$i" KILL session
  fi
done
trap - INT TERM HUP
exec 2>&3 3>&-
restore_carried

# ------------------------------------------------------------------ summary, results.tgz
{
  printf 'name\tgpu\tstart\tend\trc\tint\tterm\tkill\tcmd\n'
  for ((i = 0; i < NJOBS; i++)); do
    c=${CMDS[i]//$'\t'/ }; c=${c//$'\n'/ }
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "${NAMES[i]}" "${GPU[i]}" "${START[i]}" "${END[i]}" \
      "${RC[i]}" "${T_INT[i]}" "${T_TERM[i]}" "${T_KILL[i]}" "$c"
  done
} > "$WORK/jobs.tsv"
gpu_names=$(nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2> /dev/null)
export WORK OUT T0_MS STOP_MS NGPU TAIL_LINES RESULTS_MAX_MB CALL_LIMIT RESERVE gpu_names STOP_WHY
"$PY" - <<'PY'
import io, os, re, signal, tarfile

W, OUT = os.environ["WORK"], os.environ["OUT"]
T0, STOP = int(os.environ["T0_MS"]), int(os.environ["STOP_MS"])
TAIL = int(os.environ["TAIL_LINES"])
rows = [l.rstrip("\n").split("\t") for l in open(os.path.join(W, "jobs.tsv"))]
jobs = [dict(zip(rows[0], r)) for r in rows[1:]]

def t(ms):
    return f"+{(int(ms) - T0) / 1000:.1f}s"

def signame(n):
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"

OUTCOMES = ("passed", "failed", "errors", "skipped", "xfailed", "xpassed")
VERB = {"PASSED": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped",
        "XFAIL": "xfailed", "XPASS": "xpassed"}

def pytest_counts(text):
    """passed/failed/... of the pytest sessions in a log: from -v's per-test lines where there
    are any (they survive a kill), else from the sessions' closing lines; None: no pytest here"""
    per_test = {}
    for m in re.finditer(r"^(\S+\.py::\S+).*? (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", text, re.M):
        per_test[m.group(1)] = VERB[m.group(2)]
    for m in re.finditer(r"^(?:\[gw\d+\] \[ *\d+%\] )?(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+\.py::\S+)", text, re.M):
        per_test[m.group(2)] = VERB[m.group(1)]
    closing = re.findall(r"^=*\s*((?:\d+ \w+(?:, )?)+) in [\d.]+s", text, re.M)
    if not per_test and not closing and "test session starts" not in text:
        return None
    c = dict.fromkeys(OUTCOMES, 0)
    if per_test:
        for v in per_test.values():
            c[v] += 1
    else:
        for line in closing:
            for n, what in re.findall(r"(\d+) (\w+)", line):
                what = {"error": "errors"}.get(what, what)
                if what in c:
                    c[what] += int(n)
    selected = None
    for m in re.finditer(r"^(?:collecting \.\.\. )?collected (\d+) items?(?: / (\d+) deselected)?(?: / (\d+) selected)?", text, re.M):
        n = int(m.group(3)) if m.group(3) else int(m.group(1)) - int(m.group(2) or 0)
        selected = (selected or 0) + n
    c["selected"] = selected
    c["interrupted"] = "KeyboardInterrupt" in text or "Interrupted:" in text
    return c

lines, failed_any = [], False
gpus = os.environ.get("gpu_names", "").strip()
lines.append(f"gpu_parallel.sh: {len(jobs)} jobs on {os.environ['NGPU']} GPUs"
             + (f" ({'; '.join(gpus.splitlines())})" if gpus else "")
             + f"; call clock: CALL_LIMIT {os.environ['CALL_LIMIT']} s, SIGINT to jobs still running at"
             f" {t(STOP)} (RESERVE {os.environ['RESERVE']} s)")
table, details = [], []
for j in jobs:
    rc = int(j["rc"]) if j["rc"] else None
    wall = f"{(int(j['end']) - int(j['start'])) / 1000:.1f}s" if j["end"] else "?"
    sent = [f"SIG{s} at {t(j[k])}" for s, k in (("INT", "int"), ("TERM", "term"), ("KILL", "kill")) if j[k]]
    if not j["end"]:
        status = "still running after SIGKILL (not reaped)"
    elif sent:
        status = f"stopped {os.environ['STOP_WHY']}: " + ", ".join(sent) + f"; exit {rc}"
        if rc > 128:
            status += f" ({signame(rc - 128)})"
    elif rc == 0:
        status = "ok"
    else:
        status = f"failed: exit {rc}" + (f" ({signame(rc - 128)})" if rc > 128 else "")
    failed_any |= status != "ok"
    log = os.path.join(W, "logs", j["name"] + ".log")
    text = open(log, errors="replace").read() if os.path.exists(log) else ""
    pc = pytest_counts(text)
    ptxt = "-"
    if pc:
        ran = sum(pc[k] for k in OUTCOMES)
        ptxt = ", ".join(f"{pc[k]} {k}" for k in OUTCOMES if pc[k] or k in ("passed", "failed"))
        if pc["selected"] is not None:
            ptxt += f"; {max(pc['selected'] - ran, 0)} not run (of {pc['selected']} selected)"
        if pc["interrupted"]:
            ptxt += "; interrupted"
    table.append(f"  {j['name']:<16} GPU {j['gpu']}  {wall:>8}  {status}")
    tail = [l[:160] for l in text.rstrip("\n").splitlines()[-TAIL:]]
    details.append(f"== {j['name']} (GPU {j['gpu']}): {status}; wall {wall}, started {t(j['start'])}\n"
                   f"   command: {j['cmd']}\n"
                   + (f"   pytest: {ptxt}\n" if pc else "")
                   + f"   last {len(tail)} lines of logs/{j['name']}.log:\n"
                   + "".join(f"   | {l}\n" for l in tail))
# the table last: the device tool returns the last 12,000 characters of the output
lines += [""] + details + ["  job              GPU      wall  status"] + table
open(os.path.join(W, "summary.txt"), "w").write("\n".join(lines) + "\n")
open(os.path.join(W, "failed"), "w").write("1" if failed_any else "0")

# results.tgz: logs/, out/NAME/..., summary.txt; at most RESULTS_MAX_MB MiB
cap = int(os.environ["RESULTS_MAX_MB"]) << 20
files, skipped = [], []
for top in ("logs", "out"):
    for d, _, fs in os.walk(os.path.join(W, top)):
        for f in sorted(fs):
            p = os.path.join(d, f)
            rel = os.path.relpath(p, W)
            if not os.path.isfile(p) or os.path.islink(p):
                continue
            if top == "out" and re.match(r"tcache\.tgz\.a[a-z]$", f):
                skipped.append(f"{rel} (a Triton cache part: the call's cache has its entries; TCACHE_OUT=1)")
                continue
            files.append([rel, os.path.getsize(p), None])   # [path, size, last bytes only]
MIB = 1 << 20
dest = os.path.join(OUT, "results.tgz")

def pack():
    with tarfile.open(dest, "w:gz", compresslevel=6) as tar:
        tar.add(os.path.join(W, "summary.txt"), "summary.txt")
        err = os.path.join(W, "gpu_parallel.stderr")
        if os.path.exists(err) and os.path.getsize(err):
            tar.add(err, "gpu_parallel.stderr")
        for rel, size, cut in files:
            p = os.path.join(W, rel)
            if cut is None:
                tar.add(p, rel)
            else:
                info = tar.gettarinfo(p, rel)
                with open(p, "rb") as f:
                    f.seek(max(size - cut, 0))
                    data = f.read(cut)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return os.path.getsize(dest)

size = pack()
while size > cap and files:
    big = max(files, key=lambda x: x[2] if x[2] is not None else x[1])
    if big[0].startswith("logs/") and big[2] is None and big[1] > MIB:
        big[2] = MIB
        skipped.append(f"{big[0]} cut to its last MiB (was {big[1] / MIB:.1f} MiB)")
    else:
        files.remove(big)
        skipped.append(f"{big[0]} ({big[1] / MIB:.1f} MiB; results.tgz over {cap // MIB} MiB)")
    size = pack()
foot = [f"results.tgz: {len(files) + 1} files, {size / MIB:.2f} MiB"]
foot += [f"  left out: {s}" for s in skipped]
open(os.path.join(W, "footer.txt"), "w").write("\n".join(foot) + "\n")
PY
cp "$WORK/summary.txt" "$OUT/summary.txt"
echo >> "$OUT/summary.txt"
cat "$WORK/footer.txt" >> "$OUT/summary.txt" 2> /dev/null

# ------------------------------------------------------------------ the Triton cache (TCACHE_OUT=1)
if [ -n "${TCACHE_OUT:-}" ] && [ "$TCACHE_OUT" != 0 ]; then
  part=$(( 15 << 20 ))
  used=$(( $(stat -c %s "$OUT/results.tgz") + $(stat -c %s "$OUT/summary.txt") + (1 << 20) ))
  room=$(( (64 << 20) - used ))
  maxparts=$(( room / part + (room % part > 0 ? 1 : 0) )); maxparts=$(( maxparts < TCACHE_MAX_PARTS ? maxparts : TCACHE_MAX_PARTS ))
  maxbytes=$(( room < TCACHE_MAX_PARTS * part ? room : TCACHE_MAX_PARTS * part ))
  tc_pack() {  # WHAT [find args]: pack .tcache (those files) into $OUT/tcache.tgz.a*; 1 if too big
    local what=$1; shift
    rm -f "$OUT"/tcache.tgz.*
    (cd "$R" && find .tcache -type f ! -path '*/tmp.pid_*' "$@" -print0 |
       tar -cz --null -T - | split -b 15M -a 2 - "$OUT/tcache.tgz.")
    local n bytes
    n=$(ls "$OUT"/tcache.tgz.* 2> /dev/null | wc -l); bytes=$(cat "$OUT"/tcache.tgz.* 2> /dev/null | wc -c)
    if (( n > maxparts || bytes > maxbytes )); then
      echo "tcache ($what): $n parts, $(( bytes >> 20 )) MiB: over the $maxparts parts / $(( maxbytes >> 20 )) MiB left, not kept" >> "$OUT/summary.txt"
      rm -f "$OUT"/tcache.tgz.*; return 1
    fi
    echo "tcache ($what): $n parts (tcache.tgz.a*), $(( bytes >> 20 )) MiB: carry them next call" >> "$OUT/summary.txt"
  }
  if (( maxparts < 1 )); then
    echo "tcache: no room left beside results.tgz (64 MiB a call): not packed" >> "$OUT/summary.txt"
  else
    tc_pack "the whole cache" || tc_pack "only what this call compiled" -newer "$TC_MARK" ||
      echo "tcache: not packed (too large); lower what one call compiles, or TCACHE_MAX_PARTS (<= 5)" >> "$OUT/summary.txt"
  fi
fi
extra=$(cd "$OUT" && ls -A | grep -v -E '^(results\.tgz|summary\.txt|tcache\.tgz\.a[a-z])$')
[ -n "$extra" ] && echo "note: other files in OUT (a call returns at most 8): $(echo $extra)" >> "$OUT/summary.txt"
echo
cat "$OUT/summary.txt"
[ "$(cat "$WORK/failed" 2> /dev/null)" = 0 ]
