"""tools/gpu_parallel.sh on the CPU (GPUS=N stands in for nvidia-smi): jobs run side by side on
their GPUs, the call's deadline stops them (SIGINT, then SIGTERM, then SIGKILL) and the results
still come back as one results.tgz and one summary.txt; bad usage is refused before anything runs.

The script runs from a copy in a temporary "checkout" (it keeps Triton's cache in the checkout's
.tcache), with short limits: the whole file takes ~20 s."""

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PY = shlex.quote(sys.executable)

SLOW_TESTS = """
import time
def test_a(): pass
def test_b(): pass
def test_sleeps(): time.sleep(60)
def test_after(): pass
"""


@pytest.fixture
def repo(tmp_path):
    (tmp_path / "repo" / "tools").mkdir(parents=True)
    shutil.copy(ROOT / "tools" / "gpu_parallel.sh", tmp_path / "repo" / "tools")
    return tmp_path / "repo"


def _run(repo, *specs, env=None, timeout=60, **kw):
    e = {k: v for k, v in os.environ.items()
         if k not in ("GPUS", "CALL_T0", "CALL_LIMIT", "OUT", "DRY", "TCACHE_OUT")}
    e.update(PYTHON=sys.executable, WORK=str(repo.parent / "work"))
    e.update(env or {})
    return subprocess.run(["bash", str(repo / "tools" / "gpu_parallel.sh"), *specs], env=e,
                          capture_output=True, text=True, timeout=timeout, **kw)


def _untar(tgz, dest):
    with tarfile.open(tgz) as t:
        t.extractall(dest, filter="data")
        return sorted(t.getnames())


def _section(summary, name):
    """the summary's block of one job"""
    return summary.split(f"== {name} (")[1].split("\n\n")[0]


def test_jobs_run_side_by_side_and_the_deadline_stops_them(repo, tmp_path):
    out = tmp_path / "out"
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "test_slow.py").write_text(SLOW_TESTS)
    record = ('echo "gpu=$CUDA_VISIBLE_DEVICES out=$OUT" > $JOB_OUT/info; '
              f'{PY} -c "import time; print(time.time())" > $JOB_OUT/t0; sleep 1.5; '
              f'{PY} -c "import time; print(time.time())" > $JOB_OUT/t1')
    specs = [
        f"a::{record}",
        f"b::{record}",
        'c::echo "third job on GPU $CUDA_VISIBLE_DEVICES, name $JOB_NAME"',
        "fail::echo something broke >&2; exit 3",
        # ignores SIGINT (shell and sleep): SIGTERM stops it
        "no_int::trap '' INT; sleep 97",
        # ignores SIGINT and SIGTERM: SIGKILL stops it
        f"stubborn::{PY} -c 'import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(98)'",
        # an env assignment and a pytest run cut short by the deadline: SIGINT, its summary
        f"pyt::cd {shlex.quote(str(tmp_path / 'slow'))} && TRITON_INTERPRET=1 {PY} -m pytest -v "
        "-p no:cacheprovider test_slow.py",
    ]
    t0 = time.time()
    r = _run(repo, *specs, env=dict(GPUS="2", OUT=str(out), CALL_LIMIT="10", RESERVE="4",
                                     INT_GRACE="2", TERM_GRACE="1"))
    wall = time.time() - t0
    assert r.returncode == 1, r.stdout + r.stderr   # not every job ok
    assert wall < 20
    assert sorted(os.listdir(out)) == ["results.tgz", "summary.txt"]
    names = _untar(out / "results.tgz", tmp_path / "res")
    for n in ("a", "b", "c", "fail", "no_int", "stubborn", "pyt"):
        assert f"logs/{n}.log" in names
    assert "out/a/info" in names and "summary.txt" in names
    res = tmp_path / "res"
    # GPU i mod 2; OUT is the job's own folder
    assert (res / "out/a/info").read_text().split() == ["gpu=0", f"out={tmp_path / 'work/out/a'}"]
    assert (res / "out/b/info").read_text().split()[0] == "gpu=1"
    assert "third job on GPU 0, name c" in (res / "logs/c.log").read_text()
    # a and b ran at the same time
    a0, a1, b0, b1 = (float((res / f"out/{j}/{t}").read_text()) for j in "ab" for t in ("t0", "t1"))
    assert a0 < b1 and b0 < a1

    summary = (out / "summary.txt").read_text()
    assert summary.strip() in r.stdout          # printed at the end, too
    assert "ok" in _section(summary, "a").splitlines()[0]
    fail = _section(summary, "fail")
    assert "failed: exit 3" in fail and "something broke" in fail
    no_int = _section(summary, "no_int").splitlines()[0]
    assert "stopped at the deadline: SIGINT" in no_int and "SIGTERM" in no_int
    assert "SIGKILL" not in no_int
    assert "exit 143" in no_int
    stubborn = _section(summary, "stubborn").splitlines()[0]
    assert "SIGKILL" in stubborn and "exit 137" in stubborn
    pyt = _section(summary, "pyt")
    head = pyt.splitlines()[0]
    assert "stopped at the deadline: SIGINT" in head and "SIGTERM" not in head
    assert "exit 2" in pyt.splitlines()[0]                           # pytest's "interrupted"
    assert "pytest: 2 passed, 0 failed; 2 not run (of 4 selected); interrupted" in pyt
    log = (res / "logs/pyt.log").read_text()
    assert "test_slow.py::test_b PASSED" in log and "KeyboardInterrupt" in log
    assert "2 passed in" in log                                      # its summary line
    # nothing of the jobs runs on
    running = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            running.append(cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            pass
    assert not [c for c in running if "sleep 97" in c or "time.sleep(98)" in c]


@pytest.mark.parametrize("args, env, message", [
    ([], {}, "no jobs given"),
    (["ok::true", "no separator here"], {}, "job spec 'no separator here': no '::'"),
    (["bad name::true"], {}, "bad NAME 'bad name'"),
    (["x::true", "x::false"], {}, "NAME 'x' used twice"),
    (["x::"], {}, "empty COMMAND"),
    (["x::true", "-f", "/no/such/jobs"], {}, "jobs file '/no/such/jobs'"),
    (["x::true"], {"GPUS": "two"}, "GPUS='two'"),
    (["x::true"], {"GPUS": "0"}, "GPUS='0'"),
    (["x::true"], {"CALL_LIMIT": "9m"}, "CALL_LIMIT='9m'"),
    (["x::true"], {"CALL_T0": str(int(time.time()) - 1000)}, "CALL_LIMIT=570 s from CALL_T0"),
    (["x::true"], {"NO_GPUS": "1"}, "unknown GPU count"),
    (["x::true"], {"TCACHE_MAX_PARTS": "6"}, "TCACHE_MAX_PARTS=6: at most 5"),
])
def test_bad_usage_is_refused_before_anything_runs(repo, tmp_path, args, env, message):
    out = tmp_path / "out"
    marker = tmp_path / "ran"
    env = dict(env)
    if env.pop("NO_GPUS", None):
        # no GPUS, and an nvidia-smi that lists no GPU (this machine may have none at all)
        fake = tmp_path / "bin"
        fake.mkdir()
        (fake / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")
        (fake / "nvidia-smi").chmod(0o755)
        env["PATH"] = f"{fake}:{os.environ['PATH']}"
    else:
        env.setdefault("GPUS", "2")
    specs = [a.replace("true", f"touch {marker}") if "::" in a else a for a in args]
    r = _run(repo, *specs, env=dict(env, OUT=str(out)))
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr and r.stderr.startswith("gpu_parallel.sh: ")
    assert not marker.exists() and not out.exists()


def test_no_gpu_count_without_nvidia_smi(repo, tmp_path):
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi")
    r = _run(repo, "x::true", env=dict(OUT=str(tmp_path / "out")))
    assert r.returncode == 2 and "unknown GPU count: no nvidia-smi here; set GPUS=N" in r.stderr


def test_dry_run_prints_the_plan_and_runs_nothing(repo, tmp_path):
    jobs = tmp_path / "jobs.txt"
    jobs.write_text("# two jobs\n\nfirst::touch ran1\n  second::X=1 touch 'ran 2'\n")
    r = _run(repo, "-f", str(jobs), "third::touch ran3", env=dict(GPUS="2", DRY="1"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "3 jobs on 2 GPUs" in lines[0]
    assert [ln.split()[:3] for ln in lines[1:4]] == [
        ["first", "GPU", "0"], ["second", "GPU", "1"], ["third", "GPU", "0"]]
    assert "X=1 touch 'ran 2'" in lines[2]
    assert not list(repo.glob("ran*"))


def test_triton_cache_is_shared_carried_and_packed(repo, tmp_path):
    """A carried cache is unpacked into .tcache (and hidden from the jobs while they run), every
    job sees that folder, TCACHE_OUT=1 brings it back in 15 MiB parts, only this call's entries
    when the whole does not fit; cache parts a job writes to its $OUT and files over the size cap
    stay out of results.tgz."""
    out = tmp_path / "out"
    (repo / ".tcache" / "old").mkdir(parents=True)
    (repo / ".tcache" / "old" / "kernel.cubin").write_bytes(os.urandom(17 << 20))  # 2 parts
    subprocess.run("tar -cz .tcache | split -b 15M - .tcache.tgz.", shell=True, cwd=repo,
                   check=True)
    shutil.rmtree(repo / ".tcache")
    job = ('test "$TRITON_CACHE_DIR" = "$PWD/.tcache" && test -f .tcache/old/kernel.cubin && '
           '! ls .tcache.tgz.* 2>/dev/null && mkdir -p .tcache/new && '
           'echo $JOB_NAME > .tcache/new/$JOB_NAME && '
           'echo part > $OUT/tcache.tgz.aa && head -c 3000000 /dev/urandom > $JOB_OUT/big.bin && '
           'echo small > $JOB_OUT/small.txt')
    r = _run(repo, f"j1::{job}", f"j2::{job}",
             env=dict(GPUS="2", OUT=str(out), TCACHE_OUT="1", TCACHE_MAX_PARTS="1",
                      RESULTS_MAX_MB="2"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(os.listdir(out)) == ["results.tgz", "summary.txt", "tcache.tgz.aa"]
    summary = (out / "summary.txt").read_text()
    assert "tcache (the whole cache): 2 parts" in summary and "not kept" in summary
    assert "tcache (only what this call compiled): 1 parts" in summary
    names = subprocess.run(["tar", "-tzf", "-"], input=(out / "tcache.tgz.aa").read_bytes(),
                           capture_output=True).stdout.decode().split()
    assert sorted(names) == [".tcache/new/j1", ".tcache/new/j2"]
    # the carried parts are back where they were
    assert sorted(p.name for p in repo.glob(".tcache.tgz.a*")) == [".tcache.tgz.aa",
                                                                   ".tcache.tgz.ab"]
    names = _untar(out / "results.tgz", tmp_path / "res")
    assert "out/j1/small.txt" in names and "out/j1/tcache.tgz.aa" not in names
    assert sum(n.endswith("big.bin") for n in names) == 0   # 2 x 3 MB random > 2 MiB
    assert "out/j1/tcache.tgz.aa (a Triton cache part" in summary
    assert "out/j1/big.bin (2.9 MiB; results.tgz over 2 MiB)" in summary


def test_stopped_from_outside_still_packs(repo, tmp_path):
    out = tmp_path / "out"
    e = {k: v for k, v in os.environ.items() if k not in ("CALL_T0", "CALL_LIMIT")}
    e.update(PYTHON=sys.executable, WORK=str(tmp_path / "work"), GPUS="1", OUT=str(out))
    p = subprocess.Popen(["bash", str(repo / "tools" / "gpu_parallel.sh"),
                          "long::echo job-is-up; sleep 100"],
                         env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(100):
        if (tmp_path / "work" / "logs" / "long.log").exists() and \
                "\njob-is-up" in (tmp_path / "work" / "logs" / "long.log").read_text():
            break
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    stdout, _ = p.communicate(timeout=30)
    assert p.returncode == 1
    assert "stopped from outside" in stdout
    summary = (out / "summary.txt").read_text()
    assert "stopped when gpu_parallel.sh was signalled: SIGINT" in summary and "exit 130" in summary
    assert sorted(os.listdir(out)) == ["results.tgz", "summary.txt"]
