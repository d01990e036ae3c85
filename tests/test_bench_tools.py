"""tools/bench_ops.py without a GPU: re-reporting a saved run (table and plot), and the refusal
to measure on a machine without CUDA."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SAVED = ROOT / "docs" / "bench" / "asa-defaults-h100-2026-11-22.json"


def _bench(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "bench_ops.py"), *args],
                          capture_output=True, text=True, timeout=300)


def test_replot_prints_the_table_and_draws_the_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plot.png"
    out = _bench("--replot", str(SAVED), "--plot", str(png))
    assert out.returncode == 0, out.stderr
    saved = json.loads(SAVED.read_text())
    assert saved["gpu"] in out.stdout and saved["command"] in out.stdout
    rows = [line for line in out.stdout.splitlines() if "asa_kernel[linear]" in line]
    assert len(rows) == sum(r["impl"] == "asa_kernel[linear]" for r in saved["results"])
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_replot_reports_cuda_graph_ratios():
    """A run with --cuda-graph also gets a table of graph replays, with ratios against cuDNN's
    graph replay of the same length (not against its eager time)."""
    saved_path = ROOT / "docs" / "bench" / "asa-final-h100-2026-11-22.json"
    out = _bench("--replot", str(saved_path))
    assert out.returncode == 0, out.stderr
    graph_table = out.stdout.split("CUDA graph replays")[1]
    saved = json.loads(saved_path.read_text())
    by = {(r["T"], r["impl"]): r for r in saved["results"]}
    asa, cudnn = by[(16384, "asa_kernel[linear]")], by[(16384, "cudnn_sdpa")]
    expected = cudnn["fwd_bwd_graph_ms"] / asa["fwd_bwd_graph_ms"]
    row = next(line for line in graph_table.splitlines()
               if line.split()[:2] == ["16384", "asa_kernel[linear]"])
    assert float(row.split()[-1]) == pytest.approx(expected, abs=0.006)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_measuring_needs_cuda():
    out = _bench("--ops", "asa", "--lengths", "64")
    assert out.returncode == 2 and "needs a CUDA GPU" in out.stderr


def test_bad_repeat_count_is_refused():
    out = _bench("--repeat", "0")
    assert out.returncode == 2 and "--repeat" in out.stderr and "1 or more" in out.stderr
