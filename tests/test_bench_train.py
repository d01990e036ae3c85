"""tools/bench_train.py on the CPU: both arms (the trainer and megatron-core's GPT), the JSON, the
profile tables, and the refusals of bad input before anything runs."""

import importlib.util
import json
import math
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "bench_train.py"
TINY = ["--recipe", "tiny-cpu", "--vocab-size", "256", "--warmup", "2", "--steps", "2"]


def _tool():
    spec = importlib.util.spec_from_file_location("bench_train", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_report(report, names=("ours", "anchor")):
    arms = {r["name"]: r for r in report["arms"]}
    assert list(arms) == list(names)
    for name, r in arms.items():
        assert "error" not in r, r.get("log_tail")
        assert r["tokens_per_s"] > 0 and r["tokens_per_s_per_gpu"] > 0
        assert r["tokens_per_step"] == r["global_batch_size"] * r["seq_length"] == 2 * 64
        assert r["timed_steps"] == len(r["step_times_s"]) == 2 and r["warmup_steps"] == 2
        assert r["step_time_mean_s"] > 0 and r["step_time_stdev_s"] >= 0
        assert math.isfinite(r["mfu"]) and r["mfu"] > 0
        assert r["peak_memory_gb"] > 0 and r["optimizer_step"] is True
        assert math.isfinite(r["last_loss"]) and r["dtype"] == "fp32"
    ours, anchor = arms["ours"], arms["anchor"]
    assert anchor["kind"] == "anchor" and "local spec" in anchor["layers"]
    # the same model: parameters and model FLOPs per step
    assert ours["parameters"] == anchor["parameters"]
    assert ours["flops_per_step"] == anchor["flops_per_step"] > 0
    assert report["ratios"]["baseline"] == "anchor"
    assert report["ratios"]["ours"]["flops_per_step"] == 1.0
    assert report["ratios"]["ours"]["tokens_per_s"] > 0
    assert "real optimizer step" in report["anchor_note"]


def test_both_arms_json_and_profile(tmp_path, capsys):
    """Two arms, 2 + 2 steps each (in this process: the quick path), JSON and profile."""
    out, prof = tmp_path / "bench.json", tmp_path / "prof"
    rc = _tool().main([*TINY, "--in-process", "--peak-tflops", "1", "--json", str(out),
                       "--profile", str(prof)])
    assert rc == 0
    report = json.loads(out.read_text())
    _check_report(report)
    printed = capsys.readouterr().out
    assert "ours" in printed and "anchor" in printed and "vs anchor" in printed
    for name in ("ours", "anchor"):
        table = (prof / f"{name}.top30.txt").read_text()
        assert "Self CPU" in table and "aten::" in table
        assert (prof / f"{name}.trace.json.gz").read_bytes()[:2] == b"\x1f\x8b"  # gzip


def test_shape_without_recipe_rmsnorm_swiglu(tmp_path):
    """A shape given after -- (Transformer++'s block: RMSNorm, SwiGLU, RoPE, untied): the anchor
    builds the same model (parameters and FLOPs equal)."""
    out = tmp_path / "bench.json"
    rc = _tool().main(["--warmup", "1", "--steps", "1", "--in-process", "--vocab-size", "128",
                       "--json", str(out), "--", "--num-layers", "2", "--hidden-size", "64",
                       "--num-attention-heads", "4", "--seq-length", "32",
                       "--max-position-embeddings", "32", "--micro-batch-size", "2", "--lr", "1e-3",
                       "--swiglu", "--normalization", "RMSNorm",
                       "--untie-embeddings-and-output-weights"])
    assert rc == 0
    ours, anchor = json.loads(out.read_text())["arms"]
    assert ours["parameters"] == anchor["parameters"]
    assert ours["flops_per_step"] == anchor["flops_per_step"]
    assert ours["tokens_per_s"] > 0 and anchor["tokens_per_s"] > 0 and ours["mfu"] is None


@pytest.mark.parametrize("argv, names", [
    (["--steps", "0"], "--steps 0"),
    (["--recipe", "no-such-recipe"], "--recipe 'no-such-recipe'"),
    (["--arm", "x=nope"], "KIND 'nope'"),
    (["--arm", "a=ours", "--arm", "a=anchor"], "arm names must differ"),
    (["--peak-tflops", "-3"], "--peak-tflops -3"),
    (["--data-path", "/nonexistent/prefix"], "--data-path /nonexistent/prefix"),
    (["--arm", "ours=ours:--num-layers 0"], "--arm ours (ours)"),
    (["--arm", "ours=ours:--no-such-flag 1"], "--arm ours (ours)"),
    (["--global-batch-size", "3"], "--global-batch-size 3"),
    (["--profile-arms", "ours"], "--profile-arms ours: needs --profile"),
    (["--profile", "PROF", "--profile-arms", "ours,nope"], "--profile-arms 'ours,nope': nope"),
    (["--arm", "a=anchor:--subq-fused-norm"], "--arm a: --subq-fused-norm"),
    (["--arm", "a=anchor:--subq-fused-rope"], "--arm a: --subq-fused-rope"),
])
def test_bad_input_is_refused_before_anything_runs(argv, names, capsys, tmp_path):
    tool = _tool()
    argv = [str(tmp_path / "prof") if a == "PROF" else a for a in argv]
    with pytest.raises(SystemExit) as e:
        tool.main([*TINY, "--in-process", "--json", str(tmp_path / "x.json"), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert names in err, err
    assert not (tmp_path / "x.json").exists()


def test_anchor_with_selective_recompute(tmp_path, capsys):
    """The anchor arm honours its own --recompute-granularity selective: the config has it, the
    built model checkpoints every layer's core attention (megatron's DotProductAttention, whose
    recomputation runs on the CPU too), and the losses equal the anchor's without recompute; the
    attention-memory estimate is printed before the arms run and kept in the JSON. Only the arm
    --profile-arms names is profiled."""
    out, prof = tmp_path / "bench.json", tmp_path / "prof"
    rc = _tool().main([*TINY, "--in-process", "--json", str(out), "--arm", "anchor=anchor",
                       "--arm", "sel=anchor:--recompute-granularity selective",
                       "--profile", str(prof), "--profile-arms", "sel"])
    assert rc == 0
    plain, sel = json.loads(out.read_text())["arms"]
    assert "error" not in plain and "error" not in sel, (plain.get("log_tail"),
                                                          sel.get("log_tail"))
    assert plain["recompute"] == {"granularity": None, "modules": None,
                                  "core_attention_checkpointed_layers": 0}
    assert sel["recompute"] == {"granularity": "selective", "modules": ["core_attn"],
                                "core_attention_checkpointed_layers": 2}  # tiny-cpu: 2 layers
    assert sel["last_loss"] == pytest.approx(plain["last_loss"], rel=1e-6)
    # tiny-cpu: mb 2 x 4 heads x 64^2 fp32 scores, 4 bytes each kept per layer
    est = sel["attention_memory_estimate"]
    assert est["held_per_layer_gib"] * 2 ** 30 == 2 * 4 * 64 * 64 * 4
    assert est["held_all_layers_gib"] == 0 and plain["attention_memory_estimate"][
        "held_all_layers_gib"] == 2 * est["held_per_layer_gib"]
    printed = capsys.readouterr().out
    assert "arm sel (anchor): megatron's unfused DotProductAttention" in printed
    assert "this arm recomputes it (--recompute-granularity selective)" in printed
    assert "if that does not fit, give the arm --recompute-granularity selective" in printed
    assert sorted(p.name for p in prof.iterdir()) == ["sel.top30.txt", "sel.trace.json.gz"]
    assert plain["profile"] is None and sel["profile"]["table"].endswith("sel.top30.txt")


OOM_LOG = """[rank0]: Traceback (most recent call last):
[rank0]:   File "tools/bench_train.py", line 420, in run_worker
[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a \
total capacity of 139.81 GiB of which 1.2 GiB is free.
E1127 04:00:00 torch/distributed/elastic/multiprocessing/api.py failed (exitcode: 1)
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
tools/bench_train.py FAILED"""


def test_out_of_memory_is_reported_short(tmp_path, monkeypatch, capsys):
    """An arm that runs out of memory says ``out of memory at mb N`` (table and JSON), the failed
    allocation kept as ``oom_detail``; a child's log (torchrun's last error line is its own
    ChildFailedError) and an arm run in this process alike."""
    tool = _tool()
    arm = {"name": "anchor", "kind": "anchor", "flags": []}
    r = tool._result(arm, str(tmp_path / "none.json"), 1, OOM_LOG, 1.0, 8)
    assert r["error"] == "out of memory at mb 8" and r["oom"] is True
    assert "Tried to allocate 4.00 GiB" in r["oom_detail"]
    plain = tool._result(arm, str(tmp_path / "none.json"), 1, "ValueError: bad\nlast", 1.0, 8)
    assert plain["error"] == "ValueError: bad" and "oom" not in plain

    from megatron_subq.training import trainer

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB.")

    monkeypatch.setattr(trainer, "train_step", oom)
    out = tmp_path / "bench.json"
    rc = tool.main([*TINY, "--in-process", "--json", str(out), "--arm", "anchor=anchor"])
    assert rc == 1
    (r,) = json.loads(out.read_text())["arms"]
    assert r["error"] == "out of memory at mb 2" and "3.00 GiB" in r["oom_detail"]
    assert "failed: out of memory at mb 2" in capsys.readouterr().out


def test_dry_run_prints_each_arms_flags(capsys, tmp_path):
    rc = _tool().main([*TINY, "--dry-run", "--json", str(tmp_path / "x.json"),
                       "--arm", "a=ours:--attention-variant asa", "--arm", "b=anchor"])
    assert rc == 0 and not (tmp_path / "x.json").exists()
    lines = capsys.readouterr().out.splitlines()
    a = next(line for line in lines if line.startswith("a (ours): "))
    b = next(line for line in lines if line.startswith("b (anchor): "))
    assert a.endswith("--attention-variant asa --global-batch-size 2") and "--mock-data" in a
    assert "--attention-variant" not in b and "--vocab-size" not in b  # in the config file


def test_no_shape_is_refused():
    tool = _tool()
    with pytest.raises(SystemExit):
        tool.main(["--steps", "1"])


SCRIPT = ROOT / "tools" / "gpu_train_bench.sh"


def _dry_script(tmp_path, **env):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "DRY": "1", "OUT": str(out), **env})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def test_gpu_script_dry_run_returns_at_most_four_files(tmp_path):
    """gpu_train_bench.sh's DRY run (CPU, tiny model; two arms here, all five in the slow test):
    the summary, the JSON, one tarball of logs and top-30 tables, the traces' tar: no more than 4
    files come back (a device call returns 8), the anchor's memory estimate in the summary."""
    out, printed = _dry_script(tmp_path, ARMS="--arm ours=ours --arm 'anchor=anchor:"
                                              "--recompute-granularity selective'",
                               PROFILE_ARMS="ours")
    assert sorted(p.name for p in out.iterdir()) == [
        "bench.tgz", "bench_train.json", "bench_train.txt", "traces.tar"]
    with tarfile.open(out / "bench.tgz") as t:
        names = set(t.getnames())
    assert {"arms/ours.log", "arms/anchor.log", "arms/ours.json", "arms/recipe.yaml",
            "profile/ours.top30.txt"} <= names and "profile/anchor.top30.txt" not in names
    with tarfile.open(out / "traces.tar") as t:
        assert t.getnames() == ["profile/ours.trace.json.gz"]
    summary = (out / "bench_train.txt").read_text()
    assert "DRY run on the CPU" in summary and "this arm recomputes it" in summary
    anchor = json.loads((out / "bench_train.json").read_text())["arms"][1]
    assert anchor["recompute"]["granularity"] == "selective" and "error" not in anchor


@pytest.mark.slow
def test_gpu_script_dry_run_default_arms(tmp_path):
    """The five default arms (ours, ours-fused, anchor with selective recompute, asa, asa-fused)
    all run on the CPU; the fused arms have every fusion flag on."""
    out, _ = _dry_script(tmp_path)
    assert len(list(out.iterdir())) <= 4
    arms = {r["name"]: r for r in json.loads((out / "bench_train.json").read_text())["arms"]}
    assert list(arms) == ["ours", "ours-fused", "anchor", "asa", "asa-fused"]
    assert all("error" not in r for r in arms.values()), {n: r.get("error") for n, r in
                                                          arms.items()}
    assert arms["ours-fused"]["fusions"] == arms["asa-fused"]["fusions"] == list(
        _tool().FUSION_FLAGS)
    assert arms["ours"]["fusions"] == arms["asa"]["fusions"] == []


@pytest.mark.slow
def test_arms_in_subprocesses(tmp_path):
    """The default: each arm in its own process (as on a GPU), one extra ours arm with a flag."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(TOOL), *TINY, "--peak-tflops", "1", "--json", str(out),
         "--arm", "ours=ours", "--arm", "anchor=anchor",
         "--arm", "asa=ours:--attention-variant asa"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    _check_report({**report, "arms": report["arms"][:2]})
    asa = report["arms"][2]
    assert "error" not in asa and "asa" in asa["layers"]
    assert asa["flops_per_step"] != report["arms"][1]["flops_per_step"]  # its own core FLOPs
