"""tools/loss_match.py and tools/gpu_loss_match.sh (issue 21's loss-curve evidence): the
comparison on synthetic loss curves (within the control's noise, outside it, partial and unequal
runs, non-finite losses, a verdict per single-fusion arm), the arms (fused-each, the run order,
each arm's flags) and WARMUP, bad input refused naming the variable before anything is written,
the tarball packed even when no arm could run; and (-m slow, ~3.5 minutes on 2 cores, more on a
busy machine) the whole pipeline in its CPU dry mode."""

import json
import math
import os
import subprocess
import sys
import tarfile

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools import loss_match as lm  # noqa: E402

CORPUS = os.environ.get("SUBQ_CORPUS") or os.path.join(ROOT, "..", "shared", "data",
                                                       "docs-corpus.jsonl.xz")
SCRIPT = os.path.join(ROOT, "tools", "gpu_loss_match.sh")


def _script(tmp_path, **env):
    full = dict(os.environ, WORK=str(tmp_path / "work"), OUT=str(tmp_path / "out"), DRY="1",
                SUBQ_CORPUS=CORPUS)
    for k in ("CALL_T0", "CALL_LIMIT", "JOB_DEADLINE", "ARMS", "ITERS", "WARMUP", "MB", "GB",
              "CONTROL_MB", "FUSED_FLAGS"):
        full.pop(k, None)
    full.update(env)
    return subprocess.run(["bash", SCRIPT], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=1200)


def _write(work, arm, losses, start=1):
    with open(os.path.join(work, arm + ".jsonl"), "w") as f:
        for i, loss in enumerate(losses, start=start):
            f.write(json.dumps({"iteration": i, "lm_loss": loss, "time_s": 0.5}) + "\n")


def _curve(n, noise, seed):
    # a falling loss and a deterministic wiggle of amplitude `noise`
    return [10.0 - 0.1 * i + noise * math.sin(1.7 * i + seed) for i in range(n)]


def _plan(work, arms="unfused,fused,control", iters=40, warmup=None, fused=None):
    k = lm.check(arms, iters, 8, 16, 4, last=30, tol=1.0, fused=fused, warmup=warmup)
    lm.plan(k, "transformer-pp-1.3b-100b", "data/docs_text_document", str(work), dry=False)
    return k


def test_within_and_outside_noise():
    ref = {i: 10.0 - 0.1 * i for i in range(1, 41)}
    near = {i: v + 0.01 * (-1) ** i for i, v in ref.items()}
    far = {i: v + 0.05 for i, v in ref.items()}
    its = sorted(ref)
    s_near, s_far = lm.diff_stats(ref, near, its, 30), lm.diff_stats(ref, far, its, 30)
    assert s_near["max_abs"] == pytest.approx(0.01) and s_near["mean_signed"] == pytest.approx(0)
    assert s_far["mean_abs"] == pytest.approx(0.05) and s_far["last_window"] == 30
    # fused as close as the control: within; fused 5x further: larger, with the ratios
    v = lm.verdict(s_near, s_near, 1.0)
    assert v["verdict"] == "within bf16 noise" and v["ratio_max_abs"] == pytest.approx(1.0)
    v = lm.verdict(s_far, s_near, 1.0)
    assert v["verdict"] == "larger than bf16 noise"
    assert v["ratio_mean_abs"] == pytest.approx(5.0)
    assert lm.verdict(s_far, s_near, 6.0)["verdict"] == "within bf16 noise"  # NOISE_TOL
    # both exact (fp32-like): within; control exact and fused not: larger (infinite ratio)
    zero = lm.diff_stats(ref, dict(ref), its, 30)
    assert lm.verdict(zero, zero, 1.0)["verdict"] == "within bf16 noise"
    assert lm.verdict(s_near, zero, 1.0)["ratio_max_abs"] == math.inf
    assert lm.verdict(None, s_near, 1.0)["verdict"] == "no verdict"
    assert "control" in lm.verdict(s_near, {"iterations": 0}, 1.0)["why"]


def test_compare_partial_and_unequal_runs(tmp_path):
    """A run stopped early: every pair is compared on the iterations ALL arms reached."""
    work = tmp_path
    _plan(work, iters=40)
    _write(work, "unfused", _curve(40, 0.0, 0))
    _write(work, "fused", _curve(40, 0.002, 1))
    _write(work, "control", _curve(25, 0.004, 2))  # stopped at its deadline after 25
    with open(work / "fused.jsonl", "a") as f:  # a later line of an iteration wins
        f.write(json.dumps({"iteration": 3, "lm_loss": _curve(40, 0.002, 1)[2] + 0.001}) + "\n")
        f.write("not json\n")
    r = lm.compare(str(work), ["unfused", "fused", "control"], 40, 30, 1.0)
    assert r["common_iterations"] == 25
    assert r["arms"]["fused"]["iterations"] == 40 and r["arms"]["control"]["iterations"] == 25
    for name in ("fused", "control"):
        s = r["comparisons"][name]
        assert (s["iterations"], s["first"], s["last"], s["last_window"]) == (25, 1, 25, 25)
    assert r["verdict"] == "within bf16 noise", r
    # the command writes JSON, markdown and the plot
    assert lm.main(["compare", "--work", str(work), "--json", str(work / "r.json"), "--md",
                    str(work / "r.md"), "--plot", str(work / "r.png")]) == 0
    saved = json.load(open(work / "r.json"))
    assert saved["verdict"] == "within bf16 noise" and saved["plot"] == "r.png"
    assert os.path.getsize(work / "r.png") > 0
    md = (work / "r.md").read_text()
    assert "**Verdict: within bf16 noise**" in md and "25 of 40 planned iterations" in md
    assert "| fused | 1-25 (25) |" in md and "| fused arm |" not in md  # no single-fusion arm
    # an arm that never logged: no common iteration, no verdict
    os.remove(work / "control.jsonl")
    r = lm.compare(str(work), ["unfused", "fused", "control"], 40, 30, 1.0)
    assert r["common_iterations"] == 0 and r["verdict"] == "no verdict"
    assert "no common iterations" in lm.markdown(r, {})


def test_compare_outside_noise_and_nonfinite(tmp_path):
    work = tmp_path
    _plan(work, iters=40)
    _write(work, "unfused", _curve(40, 0.0, 0))
    _write(work, "fused", [v + 0.05 for v in _curve(40, 0.0, 0)])
    _write(work, "control", _curve(40, 0.01, 2))
    r = lm.compare(str(work), ["unfused", "fused", "control"], 40, 30, 1.0)
    assert r["verdict"] == "larger than bf16 noise" and r["ratio_mean_abs"] > 1
    assert r["comparisons"]["fused"]["mean_signed"] == pytest.approx(0.05)
    fused = _curve(40, 0.0, 0)
    fused[9] = float("nan")
    _write(work, "fused", fused)
    r = lm.compare(str(work), ["unfused", "fused", "control"], 40, 30, 1.0)
    assert r["comparisons"]["fused"]["nonfinite"] == [10]
    assert r["comparisons"]["fused"]["max_abs"] == math.inf
    assert r["verdict"] == "larger than bf16 noise"


def test_plan_writes_the_arms(tmp_path):
    k = _plan(tmp_path, arms="control,unfused,fused", iters=50)
    assert k["arms"] == ["unfused", "control", "fused"]  # the reference, then the yardstick
    cfg = yaml.safe_load(open(tmp_path / "base.yaml"))
    assert (cfg["train-iters"], cfg["global-batch-size"], cfg["micro-batch-size"]) == (50, 16, 8)
    assert cfg["data-path"] == ["data/docs_text_document"] and cfg["seq-length"] == 2048
    assert cfg["num-layers"] == 24 and cfg["eval-iters"] == 0 and cfg["log-interval"] == 1
    assert cfg["lr-warmup-iters"] == 5 and cfg["seed"] == 1234
    for key in ("save", "load", "metrics-file", "train-samples", "lr-warmup-samples",
                "data-args-path", "tensorboard-dir"):
        assert key not in cfg, key
    rows = dict(line.rstrip("\n").split("\t") for line in open(tmp_path / "arms.tsv"))
    assert rows["unfused"] == "" and rows["control"] == "--micro-batch-size 4"
    assert rows["fused"].split() == ["--" + f for f in lm.FUSION_FLAGS]
    assert len(lm.FUSION_FLAGS) == 6 and "subq-fused-adam" in lm.FUSION_FLAGS


def test_the_trainer_takes_every_arm(tmp_path):
    """Each arm's flags on the 1.3B plan pass the trainer's own parser (on the GPU a refused
    flag would cost the arms before it): the same schedule and global batch everywhere, each
    single-fusion arm with its one fusion on."""
    from megatron_subq.training import arguments

    k = _plan(tmp_path, arms="unfused,control-sdpa,control,fused,fused-each", iters=50)
    rows = dict(line.rstrip("\n").split("\t") for line in open(tmp_path / "arms.tsv"))
    got = {}
    for arm in k["arms"]:
        a = arguments.parse_args(["--config", str(tmp_path / "base.yaml"), *rows[arm].split(),
                                  "--metrics-file", str(tmp_path / f"{arm}.jsonl")],
                                 world_size=1, check_files=False)
        got[arm] = a
        assert (a.global_batch_size, a.train_iters, a.seq_length, a.seed) == (16, 50, 2048, 1234)
        assert a.bf16 and a.save is None and a.eval_iters == 0
    assert got["unfused"].micro_batch_size == 8 and got["control"].micro_batch_size == 4
    assert got["unfused"].subq_sdpa_backend == "auto"
    assert got["control-sdpa"].subq_sdpa_backend == "flash"
    assert got["control-sdpa"].micro_batch_size == 8
    assert k["arms"][:3] == ["unfused", "control-sdpa", "control"]  # the yardsticks first
    for flag in lm.FUSION_FLAGS:
        name = flag.replace("-", "_")
        assert getattr(got["fused"], name) and not getattr(got["unfused"], name), flag
        on = [f for f in lm.FUSION_FLAGS if getattr(got["fused-" + flag], f.replace("-", "_"))]
        assert on == [flag] and got["fused-" + flag].micro_batch_size == 8


def test_fused_flags_bisect_one_fusion(tmp_path):
    """FUSED_FLAGS: the fused arm takes only the named fusions (a bisection of which one moves
    the curve: the first GPU run differed by 1.8e-2 mean, the control by 4.8e-4); bad names
    are refused naming the variable."""
    k = lm.check("unfused,fused", 40, 8, 16, 4, fused="subq-fused-norm, --subq-fused-rope")
    assert k["fused_flags"] == ["subq-fused-norm", "subq-fused-rope"]
    lm.plan(k, "transformer-pp-1.3b-100b", "data/docs_text_document", str(tmp_path), dry=False)
    rows = dict(line.rstrip("\n").split("\t") for line in open(tmp_path / "arms.tsv"))
    assert rows["fused"].split() == ["--subq-fused-norm", "--subq-fused-rope"]
    assert lm.check("unfused,fused", 40, 8, 16, 4)["fused_flags"] == list(lm.FUSION_FLAGS)
    for bad in ("turbo", "subq-fused-norm,subq-fused-norm"):
        with pytest.raises(lm.LossMatchError, match="FUSED_FLAGS="):
            lm.check("unfused,fused", 40, 8, 16, 4, fused=bad)


def test_parse_arms_single_fusions():
    """fused-<fusion> arms and the fused-each shorthand, returned in the run order: unfused, the
    control, fused, the single-fusion arms in FUSION_FLAGS order."""
    singles = ["fused-" + f for f in lm.FUSION_FLAGS]
    assert lm.parse_arms("fused-each, unfused") == ["unfused"] + singles
    assert lm.parse_arms("fused-each,fused,control,unfused") == [
        "unfused", "control", "fused"] + singles
    assert lm.parse_arms("fused-subq-fused-adam,unfused,fused-subq-fused-norm,control") == [
        "unfused", "control", "fused-subq-fused-norm", "fused-subq-fused-adam"]
    with pytest.raises(lm.LossMatchError, match=r"unknown arm 'fused-turbo'; allowed: .*"
                       r"fused-each, fused-subq-fused-norm, .*fused-subq-fused-adam$"):
        lm.parse_arms("unfused,fused-turbo")
    with pytest.raises(lm.LossMatchError, match="unknown arm 'fused-'"):
        lm.parse_arms("unfused,fused-")
    for twice, name in (("unfused,control,control", "control"),
                        ("unfused,fused-bias-swiglu-fusion,fused-each", "fused-bias-swiglu-fusion"),
                        ("unfused,fused-each,fused-each", "fused-subq-fused-norm")):
        with pytest.raises(lm.LossMatchError, match=f"arm '{name}' named twice"):
            lm.parse_arms(twice)
    with pytest.raises(lm.LossMatchError, match="reference arm 'unfused'"):
        lm.parse_arms("fused-each")
    assert all(lm.is_fused(a) for a in ["fused"] + singles)
    assert not lm.is_fused("unfused") and not lm.is_fused("control")


def test_plan_single_fusion_arms(tmp_path):
    """arms.tsv: the run order, each fused-<fusion> arm with its one flag, fused with
    FUSED_FLAGS, the control with its micro-batch."""
    _plan(tmp_path, arms="fused-each,fused,unfused,control", fused="subq-fused-rope")
    rows = [line.rstrip("\n").split("\t") for line in open(tmp_path / "arms.tsv")]
    assert [r[0] for r in rows] == ["unfused", "control", "fused"] + [
        "fused-" + f for f in lm.FUSION_FLAGS]
    flags = dict(rows)
    assert flags["unfused"] == "" and flags["control"] == "--micro-batch-size 4"
    assert flags["fused"] == "--subq-fused-rope"
    for f in lm.FUSION_FLAGS:
        assert flags["fused-" + f] == "--" + f
    knobs = json.load(open(tmp_path / "knobs.json"))
    assert knobs["arms"] == [r[0] for r in rows]
    assert lm.describe("fused-subq-fused-adam") == "unfused + --subq-fused-adam"


@pytest.mark.parametrize("iters, warmup, want", [
    (40, None, 4), (40, "", 4), (6, None, 1), (5, None, 1), (40, "20", 20), (40, " 0 ", 0),
    (40, 39, 39)])
def test_warmup(tmp_path, iters, warmup, want):
    """WARMUP: ITERS/10 (at least 1) by default, else the given whole number below ITERS; it is
    base.yaml's lr-warmup-iters (every arm's schedule)."""
    k = _plan(tmp_path, iters=iters, warmup=warmup)
    assert k["warmup"] == want
    cfg = yaml.safe_load(open(tmp_path / "base.yaml"))
    assert (cfg["lr-warmup-iters"], cfg["train-iters"]) == (want, iters)
    assert "lr-warmup-samples" not in cfg and "lr-warmup-fraction" not in cfg


@pytest.mark.parametrize("warmup, message", [
    ("40", "WARMUP='40': must be less than ITERS=40"),
    ("41", "WARMUP='41': must be less than ITERS=40"),
    ("-1", "WARMUP='-1': must be a whole number >= 0"),
    ("2.5", "WARMUP='2.5': must be a whole number >= 0"),
    ("ten", "WARMUP='ten': must be a whole number >= 0")])
def test_bad_warmup(tmp_path, capsys, warmup, message):
    with pytest.raises(lm.LossMatchError, match=message):
        lm.check("unfused,control", 40, 8, 16, 4, warmup=warmup)
    assert lm.main(["plan", "--work", str(tmp_path / "w"), "--data", "x", "--arms",
                    "unfused,control", "--iters", "40", "--warmup", warmup]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "w").exists()


def test_compare_single_fusion_arms(tmp_path):
    """A bisection run: every arm's stats vs unfused, a verdict per fused-type arm against the
    control on that arm's own iterations (a cut arm neither shortens the others nor is judged
    against the control's later noise), the markdown and the plot with every arm."""
    work = tmp_path
    arms = "unfused,control,fused-each"
    _plan(work, arms=arms, iters=40)
    ref = _curve(40, 0.0, 0)
    _write(work, "unfused", ref)
    # the control: 1e-3 from unfused up to iteration 10, 2e-2 after
    _write(work, "control", [v + (0.001 if i < 10 else 0.02) for i, v in enumerate(ref)])
    _write(work, "fused-subq-fused-norm", [v + 0.05 for v in ref])  # moves the curve
    _write(work, "fused-subq-fused-rope", [v + 0.002 * (-1) ** i for i, v in enumerate(ref)])
    _write(work, "fused-bias-swiglu-fusion", ref)  # bit-identical
    _write(work, "fused-bias-dropout-fusion", [v - 0.01 for v in ref])
    _write(work, "fused-cross-entropy-loss-fusion", [v + 0.005 for v in ref[:10]])  # cut at 10
    # fused-subq-fused-adam never started: no metrics file
    r = lm.compare(str(work), lm.parse_arms(arms), 40, 30, 1.0)
    singles = ["fused-" + f for f in lm.FUSION_FLAGS]
    assert list(r["arms"]) == ["unfused", "control"] + singles
    assert list(r["comparisons"]) == ["control"] + singles and list(r["verdicts"]) == singles
    assert r["common_iterations"] == 0  # an arm logged nothing; the others are still judged
    assert r["verdict"] == "no verdict" and "no fused arm in ARMS" in r["why"]
    v = r["verdicts"]
    assert v["fused-subq-fused-norm"]["verdict"] == "larger than bf16 noise"
    assert v["fused-subq-fused-norm"]["ratio_max_abs"] == pytest.approx(2.5)
    assert v["fused-subq-fused-rope"]["verdict"] == "within bf16 noise"
    assert v["fused-bias-swiglu-fusion"]["verdict"] == "within bf16 noise"
    assert v["fused-bias-swiglu-fusion"]["ratio_max_abs"] == 0
    assert v["fused-bias-dropout-fusion"]["verdict"] == "within bf16 noise"
    assert r["comparisons"]["fused-bias-dropout-fusion"]["mean_signed"] == pytest.approx(-0.01)
    # the cut arm: 10 iterations, against the control's 1e-3 there (not its 2e-2 later)
    cut = v["fused-cross-entropy-loss-fusion"]
    assert cut["verdict"] == "larger than bf16 noise" and cut["iterations"] == 10
    assert cut["ratio_mean_abs"] == pytest.approx(5.0)
    assert r["comparisons"]["fused-cross-entropy-loss-fusion"]["iterations"] == 10
    for a in ("control", "fused-subq-fused-norm", "fused-subq-fused-rope"):
        assert r["comparisons"][a]["iterations"] == 40, a
    assert v["fused-subq-fused-adam"]["verdict"] == "no verdict"
    assert r["comparisons"]["fused-subq-fused-adam"]["iterations"] == 0
    assert r["arms"]["fused-subq-fused-norm"]["description"] == "unfused + --subq-fused-norm"
    # the command: JSON with the verdicts, a row per arm in the markdown, every arm in the plot
    assert lm.main(["compare", "--work", str(work), "--json", str(work / "r.json"), "--md",
                    str(work / "r.md"), "--plot", str(work / "r.png")]) == 0
    saved = json.load(open(work / "r.json"))
    assert {a: x["verdict"] for a, x in saved["verdicts"].items()} == {
        a: x["verdict"] for a, x in v.items()}
    assert saved["plot"] == "r.png" and os.path.getsize(work / "r.png") > 0
    md = (work / "r.md").read_text()
    assert "**Verdict:" not in md  # no fused arm: the table says it per arm
    assert "| fused-subq-fused-norm | **larger than bf16 noise**: arm/control max abs 2.50x" in md
    assert "| fused-cross-entropy-loss-fusion | **larger than bf16 noise**" in md
    assert "| fused-subq-fused-adam | **no verdict** (no losses of this arm" in md
    for a in ["unfused", "control"] + singles:
        assert f"| {a} | " in md, a
    assert "| fused-subq-fused-adam | no common iterations |" in md


def test_compare_fused_and_single_fusion_arms(tmp_path):
    """With fused and fused-<fusion> arms: the top-level verdict is the fused arm's; the
    markdown has it and the table of every fused-type arm's; no control: no verdicts."""
    work = tmp_path
    _plan(work, arms="unfused,control,fused,fused-subq-fused-norm,fused-subq-fused-rope")
    ref = _curve(40, 0.0, 0)
    _write(work, "unfused", ref)
    _write(work, "control", _curve(40, 0.01, 2))
    _write(work, "fused", [v + 0.05 for v in ref])
    _write(work, "fused-subq-fused-norm", [v + 0.05 for v in ref])
    _write(work, "fused-subq-fused-rope", _curve(40, 0.001, 3))
    arms = ["unfused", "control", "fused", "fused-subq-fused-norm", "fused-subq-fused-rope"]
    r = lm.compare(str(work), arms, 40, 30, 1.0)
    assert r["common_iterations"] == 40
    assert r["verdict"] == "larger than bf16 noise" == r["verdicts"]["fused"]["verdict"]
    assert r["ratio_mean_abs"] == r["verdicts"]["fused"]["ratio_mean_abs"]
    assert r["verdicts"]["fused-subq-fused-norm"]["verdict"] == "larger than bf16 noise"
    assert r["verdicts"]["fused-subq-fused-rope"]["verdict"] == "within bf16 noise"
    md = lm.markdown(r, {})
    assert "**Verdict: larger than bf16 noise**: arm/control" in md
    assert "| fused | **larger than bf16 noise**" in md
    assert "| fused-subq-fused-rope | **within bf16 noise**" in md
    os.remove(work / "control.jsonl")
    r = lm.compare(str(work), arms, 40, 30, 1.0)
    assert r["comparisons"]["fused"]["iterations"] == 40  # still compared with unfused
    assert {x["verdict"] for x in r["verdicts"].values()} == {"no verdict"}
    assert "no bf16-noise control" in r["verdicts"]["fused-subq-fused-rope"]["why"]


@pytest.mark.parametrize("env, message", [
    ({"FUSED_FLAGS": "turbo"}, "FUSED_FLAGS='turbo': allowed a comma list of distinct"),
    ({"ARMS": "unfused,turbo"}, "ARMS='unfused,turbo': unknown arm 'turbo'; allowed: a comma "
                                "list of unfused, control-sdpa, control, fused, fused-each, "
                                "fused-subq-fused-norm"),
    ({"ARMS": "unfused,fused-each,fused-subq-fused-adam"},
     "arm 'fused-subq-fused-adam' named twice"),
    ({"WARMUP": "6"}, "WARMUP='6': must be less than ITERS=6"),
    ({"WARMUP": "two"}, "WARMUP='two': must be a whole number >= 0"),
    ({"ARMS": "fused,control"}, "the reference arm 'unfused' must be one of them"),
    ({"ARMS": "unfused"}, "nothing to compare"),
    ({"ITERS": "0"}, "ITERS='0': must be a whole number >= 1"),
    ({"ITERS": "-5"}, "ITERS='-5': must be a whole number >= 1"),
    ({"GB": "6", "MB": "4"}, "GB=6: not a multiple of MB=4"),
    ({"CONTROL_MB": "2"}, "CONTROL_MB=2: equals MB"),
    ({"NOISE_TOL": "0"}, "NOISE_TOL='0': must be a positive number"),
    ({"CALL_T0": "soon"}, "CALL_T0='soon': not epoch seconds"),
    ({"RECIPE": "no-such"}, "RECIPE='no-such': no recipes/no-such.yaml"),
])
def test_bad_input_fails_before_anything_is_written(tmp_path, env, message):
    p = _script(tmp_path, **env)
    assert p.returncode == 2, p.stdout + p.stderr
    assert message in p.stderr, p.stderr
    assert not (tmp_path / "work").exists() and not (tmp_path / "out").exists()


def test_bad_work_folder_and_python_errors(tmp_path, capsys):
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "keep.txt").write_text("not ours")
    p = _script(tmp_path)
    assert p.returncode == 2 and "holds no earlier run of this script" in p.stderr
    assert (tmp_path / "work" / "keep.txt").exists() and not (tmp_path / "out").exists()
    assert lm.main(["plan", "--work", str(tmp_path / "w"), "--data", "x", "--last", "0"]) == 2
    assert "LAST='0'" in capsys.readouterr().err and not (tmp_path / "w").exists()
    assert lm.main(["compare", "--work", str(tmp_path / "none"), "--json", "j", "--md", "m"]) == 2


def test_packs_even_when_no_arm_can_run(tmp_path):
    """A deadline too close for any arm: the comparison ("no verdict") and the tarball still
    come back, and the script says it failed."""
    # the corpus slice (~10-20 s) fits before the stop; no arm's MIN_RUN does
    p = _script(tmp_path, CALL_LIMIT="100", RESERVE="25", MIN_RUN="90")
    assert p.returncode == 1, p.stdout + p.stderr
    for arm in ("unfused", "fused", "control"):
        assert f"arm {arm} not started" in p.stdout
    out = tmp_path / "out"
    assert sorted(os.listdir(out)) == ["loss-match.tgz", "loss_match.md"]
    assert "**Verdict: no verdict**" in (out / "loss_match.md").read_text()
    names = tarfile.open(out / "loss-match.tgz").getnames()
    assert "./loss_match.json" in names and "./base.yaml" in names
    # a deadline that cuts the preprocessing short: still the summary and the tarball
    p = _script(tmp_path, CALL_LIMIT="28", RESERVE="25")
    assert p.returncode == 1 and "preprocessing failed" in p.stderr, p.stdout + p.stderr
    assert sorted(os.listdir(out)) == ["loss-match.tgz", "loss_match.md"]
    assert "**Verdict: no verdict**" in (out / "loss_match.md").read_text()


@pytest.mark.slow
def test_dry_run_end_to_end(tmp_path):
    """The script's CPU dry mode: the tiny shape of the 1.3B recipe on a slice of the docs
    corpus, four arms (one single-fusion) of 6 iterations with WARMUP 2, compared; $OUT holds
    the tarball and the summary."""
    p = _script(tmp_path, CALL_LIMIT="1100", WARMUP="2",
                ARMS="unfused,fused-subq-fused-norm,fused,control")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    out = tmp_path / "out"
    assert sorted(os.listdir(out)) == ["loss-match.tgz", "loss_match.md"]
    names = set(tarfile.open(out / "loss-match.tgz").getnames())
    for arm in ("unfused", "fused", "control", "fused-subq-fused-norm"):
        assert {f"./{arm}.jsonl", f"./{arm}.log"} <= names
    assert {"./loss_match.json", "./loss_match.png", "./base.yaml", "./arms.tsv"} <= names
    assert not any(n.startswith(("./data", "./cache")) for n in names)  # no data, no index
    r = json.load(open(tmp_path / "work" / "loss_match.json"))
    assert r["common_iterations"] == 6 and r["plot"] == "loss_match.png"
    assert r["verdict"] in ("within bf16 noise", "larger than bf16 noise")
    assert r["verdict"] == r["verdicts"]["fused"]["verdict"]
    assert list(r["arms"]) == ["unfused", "control", "fused", "fused-subq-fused-norm"]
    assert r["verdicts"]["fused-subq-fused-norm"]["verdict"] in (
        "within bf16 noise", "larger than bf16 noise")
    lrs = [json.loads(line)["lr"] for line in open(tmp_path / "work" / "unfused.jsonl")]
    assert max(lrs) == lrs[1]  # WARMUP 2: the peak at iteration 2
    for name in ("fused", "control", "fused-subq-fused-norm"):
        s = r["comparisons"][name]
        # the same data and seed: the curves agree to bf16 rounding on the tiny model
        assert s["iterations"] == 6 and s["max_abs"] < 0.05, s
    cfg = yaml.safe_load(open(tmp_path / "work" / "base.yaml"))
    assert cfg["seq-length"] == 128 and cfg["bf16"] is True and cfg["num-layers"] == 2
    assert cfg["lr-warmup-iters"] == 2
    assert "| fused-subq-fused-norm | **" in (out / "loss_match.md").read_text()
    assert (out / "loss_match.md").read_text() in p.stdout


def test_sdpa_control_is_the_yardstick(tmp_path):
    """With control-sdpa in ARMS the verdicts are judged against it, not the micro-batch control:
    the same fused arm is within the (larger) bf16 yardstick and outside the smaller one."""
    n = 20
    ref = _curve(n, 0.0, 0)
    _write(tmp_path, "unfused", ref)
    _write(tmp_path, "control", [x + 0.002 * (-1) ** i for i, x in enumerate(ref)])
    _write(tmp_path, "control-sdpa", [x + 0.03 * (-1) ** i for i, x in enumerate(ref)])
    _write(tmp_path, "fused", [x + 0.02 * (-1) ** i for i, x in enumerate(ref)])
    r = lm.compare(str(tmp_path), ["unfused", "control-sdpa", "control", "fused"], n, 30, 1.0)
    assert r["noise_arm"] == "control-sdpa" and r["verdict"] == "within bf16 noise"
    r = lm.compare(str(tmp_path), ["unfused", "control", "fused"], n, 30, 1.0)
    assert r["noise_arm"] == "control" and r["verdict"] == "larger than bf16 noise"
    assert "control-sdpa" in lm.describe("control-sdpa") or "flash" in lm.describe("control-sdpa")


def test_sdpa_backend_flag_sets_torch_switches():
    """--subq-sdpa-backend NAME allows only that SDPA backend; auto leaves torch's switches."""
    import torch

    from megatron_subq.training import arguments

    names = arguments.SDPA_BACKENDS[1:]
    before = {n: getattr(torch.backends.cuda, f"{n}_sdp_enabled")() for n in names}
    try:
        arguments.apply_sdpa_backend("flash")
        assert {n: getattr(torch.backends.cuda, f"{n}_sdp_enabled")() for n in names} == {
            "cudnn": False, "flash": True, "mem_efficient": False, "math": False}
        arguments.apply_sdpa_backend("auto")
        assert torch.backends.cuda.flash_sdp_enabled()
        assert not torch.backends.cuda.math_sdp_enabled()
    finally:
        for n, on in before.items():
            getattr(torch.backends.cuda, f"enable_{n}_sdp")(on)
    with pytest.raises(SystemExit):
        arguments.parse_args(["--subq-sdpa-backend", "fast"], world_size=1, check_files=False)
