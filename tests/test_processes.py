"""megatron_subq/training/processes.py: workers die with their torchrun agent, checkpoint writers
and megatron's save Manager with their worker, and the --save lock.

The process tests run tiny Python children that load processes.py by path (no torch import), so
each costs a Python start-up; only the Manager test imports megatron-core (the real spawn path).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_subq.training import processes  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="PR_SET_PDEATHSIG is Linux-only")

# children import processes.py as a top-level module: no megatron_subq/torch import
TRAINING = os.path.join(ROOT, "megatron_subq", "training")
PRELUDE = f"import json, os, sys, time\nsys.path.insert(0, {TRAINING!r})\nimport processes\n"


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_for(predicate, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _read_json(path):
    try:
        with open(path) as f:
            return json.loads(f.read())
    except (FileNotFoundError, ValueError):
        return None


def _kill(*pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _agent_with_worker(tmp_path, torchrun: bool):
    """A fake torchrun agent (a Python process) that starts a worker running the trainer's
    start-up call ``die_with_launcher`` and sleeps. Returns (agent Popen, worker PID)."""
    ready = tmp_path / f"worker-{torchrun}.json"
    worker = PRELUDE + textwrap.dedent(f"""
        processes.die_with_launcher()
        with open({str(ready)!r} + ".tmp", "w") as f:
            f.write(json.dumps({{"pid": os.getpid(), "sig": processes.parent_death_signal()}}))
        os.replace({str(ready)!r} + ".tmp", {str(ready)!r})
        time.sleep(600)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    if torchrun:
        env["TORCHELASTIC_RUN_ID"] = "test"
    agent_code = ("import subprocess, sys, time\n"
                  f"subprocess.Popen([sys.executable, '-c', {worker!r}])\ntime.sleep(600)\n")
    agent = subprocess.Popen([sys.executable, "-c", agent_code], env=env)
    try:
        info = _wait_for(lambda: _read_json(ready), what="the worker's start-up")
    except BaseException:
        agent.kill()
        raise
    return agent, info


def test_worker_dies_with_its_torchrun_agent(tmp_path):
    agent, info = _agent_with_worker(tmp_path, torchrun=True)
    try:
        assert info["sig"] == signal.SIGKILL
        agent.kill()
        agent.wait()
        _wait_for(lambda: not _alive(info["pid"]), timeout=10, what="the worker to die")
    finally:
        _kill(agent.pid, info["pid"])


def test_worker_without_torchrun_outlives_its_parent(tmp_path):
    """Plain `python pretrain_gpt.py`: the parent is a shell; nohup'ed runs must go on."""
    agent, info = _agent_with_worker(tmp_path, torchrun=False)
    try:
        assert info["sig"] == 0
        agent.kill()
        agent.wait()
        time.sleep(1.0)
        assert _alive(info["pid"])
    finally:
        _kill(agent.pid, info["pid"])


def test_die_with_parent_when_the_parent_is_already_gone():
    """The race: the parent died before the prctl (we were re-parented): die at once."""
    code = PRELUDE + "processes.die_with_parent(expected_parent=os.getppid() + 10**6)\n" \
        "time.sleep(30)\n"
    proc = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == -signal.SIGKILL


def _fork_and_report_pdeathsig() -> int:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave at once
        os.write(write, str(processes.parent_death_signal()).encode())
        os._exit(0)
    os.close(write)
    value = int(os.read(read, 16))
    os.close(read)
    os.waitpid(pid, 0)
    return value


def test_forked_children_of_the_main_thread_get_pdeathsig():
    try:
        assert processes.install_child_reaping()
        assert _fork_and_report_pdeathsig() == signal.SIGKILL
        # a child of another thread is left alone (it would die when that thread ends)
        seen = []
        thread = threading.Thread(target=lambda: seen.append(_fork_and_report_pdeathsig()))
        thread.start()
        thread.join()
        assert seen == [0]
    finally:
        processes.uninstall_child_reaping()
    assert _fork_and_report_pdeathsig() == 0


def test_megatron_save_manager_and_writers_die_with_their_worker(tmp_path):
    """megatron's torch_dist save spawns a Manager (its results queue) and forks writers; after a
    ``kill -9`` of the worker they (and multiprocessing's resource tracker) must go too."""
    out = tmp_path / "pids.json"
    worker = PRELUDE + textwrap.dedent(f"""
        import multiprocessing
        from megatron.core.dist_checkpointing.strategies import filesystem_async
        processes.install_child_reaping()
        filesystem_async._get_write_results_queue()  # spawns megatron's Manager
        writer = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
        writer.start()
        me = os.getpid()
        children = [int(p) for p in os.listdir("/proc") if p.isdigit() and p != str(me)
                    and open(f"/proc/{{p}}/stat").read().rsplit(")", 1)[1].split()[1] == str(me)]
        with open({str(out)!r} + ".tmp", "w") as f:
            f.write(json.dumps({{"worker": me, "writer": writer.pid, "children": children}}))
        os.replace({str(out)!r} + ".tmp", {str(out)!r})
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", worker])
    pids = None
    try:
        pids = _wait_for(lambda: _read_json(out), timeout=120, what="the worker's Manager")
        # the Manager, the resource tracker and the writer
        assert len(pids["children"]) >= 3 and pids["writer"] in pids["children"], pids
        proc.kill()
        proc.wait()
        _wait_for(lambda: not any(_alive(p) for p in pids["children"]), timeout=15,
                  what=f"the worker's children {pids['children']} to die")
    finally:
        _kill(proc.pid, *(pids["children"] if pids else []))


# ---- the --save lock ----------------------------------------------------------------------------
def test_save_lock_second_holder_gets_a_clear_error(tmp_path):
    first = processes.SaveLock(str(tmp_path)).acquire()
    try:
        with pytest.raises(processes.SaveFolderLocked) as e:
            processes.SaveLock(str(tmp_path)).acquire()
        message = str(e.value)
        assert f"--save {tmp_path}" in message
        assert os.path.join(str(tmp_path), processes.LOCK_NAME) in message
        assert f"PID {os.getpid()} on host {socket.gethostname()}" in message
    finally:
        first.release()
    assert not os.path.exists(tmp_path / processes.LOCK_NAME)
    processes.SaveLock(str(tmp_path)).acquire().release()  # free again


def test_save_lock_held_by_another_process_then_taken_over_after_it_dies(tmp_path):
    ready = tmp_path / "ready"
    holder = subprocess.Popen([sys.executable, "-c", PRELUDE + (
        f"processes.SaveLock({str(tmp_path / 'save')!r}).acquire()\n"
        f"open({str(ready)!r}, 'w').close()\ntime.sleep(600)\n")])
    try:
        _wait_for(ready.exists, what="the holder")
        with pytest.raises(processes.SaveFolderLocked, match=f"PID {holder.pid} on host"):
            processes.SaveLock(str(tmp_path / "save")).acquire()
    finally:
        holder.kill()
        holder.wait()
    notes = []
    lock = processes.SaveLock(str(tmp_path / "save")).acquire(log=notes.append)
    try:
        assert len(notes) == 1 and "stale lock" in notes[0] and f"PID {holder.pid}" in notes[0]
        assert json.loads((tmp_path / "save" / processes.LOCK_NAME).read_text())["pid"] == \
            os.getpid()
    finally:
        lock.release()


def test_stale_lock_file_of_a_dead_pid_is_taken_over(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / processes.LOCK_NAME).write_text(json.dumps(
        {"pid": dead.pid, "host": socket.gethostname(), "started": "2026-01-01T00:00:00"}))
    notes = []
    lock = processes.SaveLock(str(tmp_path)).acquire(log=notes.append)
    try:
        assert lock.held
        assert len(notes) == 1 and f"stale lock {tmp_path / processes.LOCK_NAME}" in notes[0]
        assert f"PID {dead.pid}" in notes[0]
    finally:
        lock.release()


def _descendants(pid: int) -> list:
    parents = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    parents[int(p)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        children = [c for c, pp in parents.items() if pp == parent]
        out += children
        todo += children
    return out


def test_kill_9_of_a_torchrun_worker_leaves_no_process_behind(tmp_path):
    """The issue's scenario end to end: torchrun, 2 workers saving every 5 iterations; once a
    checkpoint is on disk, ``kill -9`` the rank-0 worker (the lock's holder). torchrun stops the
    other worker; the killed worker's save Manager, resource tracker and forked children must go
    too (before, the Manager and the tracker lived for ever)."""
    from megatron_subq.distributed import free_port

    save = tmp_path / "save"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           os.path.join(ROOT, "examples", "pretrain_gpt.py"),
           "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
           "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "2",
           "--train-iters", "100000", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
           "NullTokenizer", "--vocab-size", "128", "--eval-iters", "0", "--eval-interval",
           "100000", "--log-interval", "1000", "--save", str(save), "--save-interval", "5"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(tmp_path / "log", "w") as log:
        agent = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    tree = []
    try:
        _wait_for(lambda: (save / "latest_checkpointed_iteration.txt").exists(), timeout=300,
                  what="the first checkpoint")
        holder = json.loads((save / processes.LOCK_NAME).read_text())["pid"]
        tree = _descendants(agent.pid)
        assert holder in tree and len(_descendants(holder)) >= 2, (holder, tree)  # Manager+tracker
        os.kill(holder, signal.SIGKILL)
        agent.wait(timeout=120)
        _wait_for(lambda: not [p for p in tree if _alive(p)], timeout=20,
                  what=f"the processes of the run {tree} to die")
    finally:
        _kill(agent.pid, *tree)
