"""recipes/slurm/train.sbatch on one host: a simulated two-node job (two torchrun agents,
``--nnodes 2``, c10d rendezvous on localhost, gloo), TP=2 x DP=2 across the two "nodes".

Slurm's ``srun`` and ``scontrol`` are replaced by the stand-ins in tests/data/fake_slurm (one
task per node in its own process group; requeue recorded). Three launches: an uninterrupted job
(A); a job whose second "node" is killed after its first checkpoint (B), which must requeue
itself; and B's requeued attempt, which must resume from B's last complete checkpoint and end
with A's loss at every iteration. The slow variant adds the time limit: B's requeued attempt,
signalled as Slurm does near it, requeues again, saves where it is and exits; a third attempt
resumes there and finishes.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_subq.distributed import free_port  # noqa: E402
from megatron_subq.training.checkpointing import read_tracker  # noqa: E402

FAKE_SLURM = os.path.join(ROOT, "tests", "data", "fake_slurm")
SBATCH = os.path.join(ROOT, "recipes", "slurm", "train.sbatch")
ITERS, SAVE_EVERY = 9, 3


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The tiny recipe (TP=2, 2 micro-batches per DP rank) and the data it reads."""
    from test_trainer import corpus_slice

    work = tmp_path_factory.mktemp("multinode")
    out, model = corpus_slice(work, 60)
    recipe = work / "tiny-2node.yaml"
    recipe.write_text("\n".join([
        "num-layers: 2", "hidden-size: 64", "num-attention-heads: 4", "num-query-groups: 2",
        "seq-length: 64", "micro-batch-size: 2", "global-batch-size: 8",
        f"train-iters: {ITERS}", "lr: 3.0e-3", "min-lr: 3.0e-4", "lr-decay-style: cosine",
        "lr-warmup-iters: 2", "tensor-model-parallel-size: 2", "sequence-parallel: true",
        "use-distributed-optimizer: true", "attention-variant: asa",
        f"data-path: [{out['prefixes']['text']}]", "split: \"90,10,0\"",
        "tokenizer-type: GPTSentencePieceTokenizer", f"tokenizer-model: {model}",
        "num-workers: 0", "log-interval: 1", "eval-interval: 100", "eval-iters: 1",
        f"save-interval: {SAVE_EVERY}", "seed: 1234", "exit-signal-handler: true", ""]))
    return {"work": work, "recipe": str(recipe)}


def _submit(job, name, job_id, restart_count=0, background=False):
    """sbatch as Slurm would start it on the first of 2 nodes (2 processes each)."""
    work = job["work"]
    env = dict(os.environ, PATH=FAKE_SLURM + os.pathsep + os.environ["PATH"],
               SLURM_JOB_ID=str(job_id), SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="node[1-2]",
               SLURM_SUBMIT_DIR=ROOT, SLURM_RESTART_COUNT=str(restart_count),
               SUBQ_GPUS_PER_NODE="2", SUBQ_PYTHON=sys.executable, MASTER_PORT=str(free_port()),
               FAKE_SRUN_PIDS=str(work / f"{name}.pids"),
               FAKE_REQUEUED=str(work / f"{name[:-1]}requeued"),
               OMP_NUM_THREADS="1", SUBQ_GPU="H100")
    cmd = ["bash", SBATCH, job["recipe"], "--save", str(work / name),
           "--metrics-file", str(work / f"{name}.jsonl")]
    log = open(work / f"{name}.attempt{restart_count}.out", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                            start_new_session=True)
    if background:
        return proc
    try:
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = (work / f"{name}.attempt{restart_count}.out").read_text()
    assert rc == 0, f"sbatch {name} failed ({rc}):\n{text[-6000:]}"
    return text


def _losses(path):
    """iteration -> the loss of its last attempt (a requeued run appends to the same file)."""
    losses = {}
    for line in open(path):
        record = json.loads(line)
        if "lm_loss" in record:
            losses[record["iteration"]] = record["lm_loss"]
    return losses


@pytest.mark.parametrize("time_limit", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["kill-requeue", "kill-requeue-time-limit"])
def test_two_nodes_kill_one_and_requeue_resumes_the_same_curve(job, time_limit):
    """kill-requeue: A; B killed and requeued; B's next attempt finishes. kill-requeue-time-limit
    (slow: one launch more): B's next attempt is signalled near its time limit, saves where it is
    and requeues again, and a third attempt finishes."""
    work, tag = job["work"], "t" if time_limit else ""
    a_name, b_name = f"{tag}a", f"{tag}b"
    out_a = _submit(job, a_name, 101)
    assert "2 node(s) x 2 GPU(s)" in out_a and read_tracker(str(work / a_name)) == ITERS
    assert "TP 2" in out_a and "DP 2" in out_a, out_a[:3000]  # tools/plan_run.py's plan
    a = _losses(work / f"{a_name}.jsonl")
    assert sorted(a) == list(range(1, ITERS + 1))
    node_logs = sorted(os.listdir(work / a_name / "logs" / "job-101"))
    assert node_logs == ["node0.attempt0.log", "node1.attempt0.log"], node_logs

    # B: kill "node" 1 (its agent and workers) once the first checkpoint is complete
    requeued = work / f"{tag}requeued"
    proc = _submit(job, b_name, 202, background=True)
    deadline = time.time() + 400
    while read_tracker(str(work / b_name)) is None:
        assert proc.poll() is None and time.time() < deadline, \
            (work / f"{b_name}.attempt0.out").read_text()[-4000:]
        time.sleep(0.5)
    pids = dict(line.split() for line in open(work / f"{b_name}.pids"))
    os.killpg(int(pids["1"]), signal.SIGKILL)
    rc = proc.wait(timeout=300)
    first = (work / f"{b_name}.attempt0.out").read_text()
    assert rc != 0, first[-3000:]
    assert "requeueing job 202" in first and open(requeued).read().split() == ["202"]
    resumed_from = read_tracker(str(work / b_name))
    assert resumed_from is not None and resumed_from < ITERS
    last_attempt, loaded_from = 1, resumed_from

    if time_limit:
        # B's requeued attempt (Slurm sets SLURM_RESTART_COUNT) resumes; near its "time limit"
        # (Slurm's --signal=B:USR1 to the batch script) it requeues itself and stops the step
        # with SIGTERM, on which the trainer (--exit-signal-handler) saves where it is and exits
        proc = _submit(job, b_name, 202, restart_count=1, background=True)
        metrics = work / f"{b_name}.jsonl"
        seen = len(open(metrics).read().splitlines())
        deadline = time.time() + 400
        while len(open(metrics).read().splitlines()) == seen:
            assert proc.poll() is None and time.time() < deadline, \
                (work / f"{b_name}.attempt1.out").read_text()[-4000:]
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGUSR1)
        rc = proc.wait(timeout=300)
        second = (work / f"{b_name}.attempt1.out").read_text()
        node0 = (work / b_name / "logs" / "job-202" / "node0.attempt1.log").read_text()
        assert rc == 0, second[-3000:]
        assert f"loaded checkpoint at iteration {resumed_from} " in node0, node0[-3000:]
        assert "time limit near: requeueing job 202" in second, second[-3000:]
        assert open(requeued).read().split() == ["202", "202"]
        stopped_at = read_tracker(str(work / b_name))
        assert f"exiting at iteration {stopped_at}: SIGTERM received" in second, second[-3000:]
        assert resumed_from < stopped_at < ITERS, (resumed_from, stopped_at)
        last_attempt, loaded_from = 2, stopped_at

    # the last attempt (Slurm sets SLURM_RESTART_COUNT) resumes and finishes the run
    _submit(job, b_name, 202, restart_count=last_attempt)
    node0 = (work / b_name / "logs" / "job-202" / f"node0.attempt{last_attempt}.log").read_text()
    assert f"loaded checkpoint at iteration {loaded_from} " in node0, node0[-3000:]
    assert read_tracker(str(work / b_name)) == ITERS
    b = _losses(work / f"{b_name}.jsonl")
    assert sorted(b) == list(range(1, ITERS + 1))
    for it in a:  # same data order, same seeds, same reduction topology: the same numbers
        assert b[it] == pytest.approx(a[it], rel=1e-6, abs=0), (it, a[it], b[it])


def test_fake_srun_gives_each_node_its_gpus():
    """The stand-in srun's FAKE_SRUN_NODE_GPUS (tools/gpu_multi.sh twonode: two "nodes" of two
    GPUs on one host) sets each node's CUDA_VISIBLE_DEVICES; unset, it leaves the variable alone."""
    script = 'echo "$SLURM_NODEID ${CUDA_VISIBLE_DEVICES-unset}"'
    for gpus, want in (("0,1 2,3", ["0 0,1", "1 2,3"]), (None, ["0 unset", "1 unset"])):
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        env.update(SLURM_JOB_NUM_NODES="2")
        if gpus:
            env["FAKE_SRUN_NODE_GPUS"] = gpus
        out = subprocess.run(["bash", os.path.join(FAKE_SLURM, "srun"), "--ntasks-per-node=1",
                              "bash", "-c", script], env=env, capture_output=True, text=True,
                             timeout=30, check=True).stdout
        assert sorted(out.split("\n")[:-1]) == want, out


def test_exit_conditions_without_a_world():
    """--exit-duration-in-mins and --exit-signal-handler decide alone when there is no world;
    the launches above cover the all-reduce."""
    import torch

    from megatron_subq.training.exits import ExitConditions

    assert ExitConditions(False, None, torch.device("cpu")).reason() == ""
    assert ExitConditions(False, 0.0, torch.device("cpu")).reason() == \
        "--exit-duration-in-mins reached"
    assert ExitConditions(False, 60.0, torch.device("cpu")).reason() == ""
    exits = ExitConditions(True, None, torch.device("cpu"))
    before = signal.getsignal(signal.SIGTERM)
    exits.install()
    try:
        assert exits.reason() == ""
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert exits.reason() == "SIGTERM received (--exit-signal-handler)"
    finally:
        exits.restore()
    assert signal.getsignal(signal.SIGTERM) is before
