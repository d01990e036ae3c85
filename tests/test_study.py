"""tools/study.py: arms and stages run through the trainer with identical budgets, stage 2
resumes stage 1's weights, and the plot/table read what was written."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "data", "study", "tiny.yaml")


def _tool(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "study.py"), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)


def test_study_runs_stages_and_plots(tmp_path):
    out = str(tmp_path / "tiny")
    r = _tool("run", TINY, "--out", out, "--arms", "asa")  # one arm: each launch costs ~10 s
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert sorted(summary) == ["asa.stage1", "asa.stage2"], open(
        os.path.join(out, "asa.stage1.log")).read()[-3000:]
    for tag, info in summary.items():
        assert info["exit"] == 0, tag
        stage1 = tag.endswith("stage1")
        assert info["iterations"] == (4 if stage1 else 2)
        assert info["tokens"] == (4 * 4 * 16 if stage1 else 2 * 4 * 32)
        assert info["final_valid_loss"] is not None
    log = open(os.path.join(out, "asa.stage2.log")).read()
    assert "asa.stage1" in log  # stage 2 loaded stage 1's checkpoint
    png = str(tmp_path / "loss.png")
    r = _tool("plot", out, "--output", png, "--smooth", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert os.path.getsize(png) > 1000 and "| asa.stage2 |" in r.stdout


def test_unknown_arm_is_named(tmp_path):
    r = _tool("run", TINY, "--out", str(tmp_path), "--arms", "standard,nope")
    assert r.returncode != 0 and "--arms" in r.stderr and "nope" in r.stderr
