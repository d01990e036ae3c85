"""tools/plot_losses.py: the loss-comparison plot of docs/results.md's multi-GPU runs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import plot_losses  # noqa: E402

pytest.importorskip("matplotlib")


def _metrics(path, losses, extra=()):
    with open(path, "w") as f:
        for i, loss in enumerate(losses, 1):
            f.write(json.dumps({"iteration": i, "lm_loss": loss, "time_s": 0.1}) + "\n")
        f.write("not json\n")
        for i, loss in extra:  # a resumed attempt: iterations logged again
            f.write(json.dumps({"iteration": i, "lm_loss": loss}) + "\n")


def test_resumed_attempt_wins_and_png_written(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _metrics(a, [3.0, 2.5, 2.0, 1.8])
    _metrics(b, [3.0, 2.5, 2.2], extra=[(3, 2.05), (4, 1.85)])
    assert plot_losses.read_losses(str(b)) == {1: 3.0, 2: 2.5, 3: 2.05, 4: 1.85}
    out = tmp_path / "loss.png"
    assert plot_losses.main([str(a), str(b), "--labels", "A", "B", "--output", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("*.tmp.png"))


@pytest.mark.parametrize("args, message", [
    (["--labels", "only-one"], "--labels: 1 labels for 2 files"),
    (["--output", "loss.svg"], "--output must name a .png"),
])
def test_bad_arguments_name_the_flag(tmp_path, args, message):
    a = tmp_path / "a.jsonl"
    _metrics(a, [1.0])
    argv = [sys.executable, str(ROOT / "tools" / "plot_losses.py"), str(a), str(a)]
    if "--output" not in args:
        args = args + ["--output", str(tmp_path / "x.png")]
    r = subprocess.run(argv + args, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and message in r.stderr
    assert not (tmp_path / "x.png").exists()
