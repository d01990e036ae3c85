"""Issue 21's loss-curve check: does the fused path change the math? The logic behind
tools/gpu_loss_match.sh (which runs the arms on one GPU and calls this file's subcommands).

    python tools/loss_match.py check --arms unfused,fused,control --iters 50 --mb 8 --gb 16 \\
        --control-mb 4                                   # validate only, write nothing
    python tools/loss_match.py plan --work W --data PREFIX ...   # W/base.yaml, W/arms.tsv
    python tools/loss_match.py compare --work W --json J --md M --plot P

Arms (``ARMS``, a comma list; the reference ``unfused`` must be one of them):

* ``unfused``: the recipe as it is (the default local path), micro-batch MB, global batch GB;
* ``fused``: the same plus the six fusions that run without TE/apex (``bench_train.FUSION_FLAGS``,
  the ``ours-fused`` arm of tools/gpu_train_bench.sh);
* ``control``: ``unfused`` at micro-batch CONTROL_MB (same global batch, so more accumulation
  steps): the same math up to bf16 summation order, the bf16-noise yardstick (the control of
  issue 25's hybrid comparison, docs/results.md).

Every arm has the same seed, data, global batch and schedule, so the same samples in the same
order (megatron's sampler walks the dataset in global batches; the split into micro-batches does
not reorder them).

The comparison (``compare``) reads each arm's metrics file (``WORK/ARM.jsonl``: the trainer's
``--metrics-file``, one line per iteration with ``lm_loss``; a later line of an iteration wins)
and, for each arm against ``unfused``, over the iterations EVERY arm logged (a run stopped at the
deadline is compared on what all arms reached): ``max_abs`` (and its iteration), ``mean_abs``,
``mean_signed`` (arm - unfused), ``last_mean_abs`` (mean abs over the last LAST (30) of those
iterations, all of them when fewer). A non-finite loss in that range counts as an infinite
difference.

The rule (the verdict on the fused arm): **within bf16 noise** when the fused arm's ``max_abs``
and ``mean_abs`` are each at most NOISE_TOL (1.0) times the control's over the same iterations;
otherwise **larger than bf16 noise** (the ratios say by how much). Without the control or the
fused arm, or with no iteration common to all arms, the verdict is **no verdict** (and says why).
Caveat: the control is one draw of the noise; when both arms only differ by noise, either may be
the larger, so ratios a little above 1 say little: read them with the plot.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

ARMS = ("unfused", "fused", "control")
REFERENCE = "unfused"
# the six fusions that run without TE/apex: gpu_train_bench.sh's ours-fused arm (bench_train.py
# imports torch only inside its functions)
from bench_train import DROPPED_KEYS, FUSION_FLAGS  # noqa: E402
from plot_losses import read_records  # noqa: E402
DESCRIPTION = {
    "unfused": "the recipe's default local path",
    "fused": "unfused + " + " ".join("--" + f for f in FUSION_FLAGS),
    "control": "unfused at micro-batch CONTROL_MB (same global batch): the bf16-noise yardstick"}
# the DRY (CPU) model: a tiny Transformer++ (RoPE, SwiGLU, RMSNorm, untied), bf16 because
# --cross-entropy-loss-fusion refuses fp32 (it rounds the logits' gradient to bf16)
DRY_SHAPE = {"num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "kv-channels": 16,
             "ffn-hidden-size": 128, "seq-length": 128, "max-position-embeddings": 128,
             "bf16": True, "use-distributed-optimizer": False, "overlap-grad-reduce": False,
             "overlap-param-gather": False, "num-workers": 0}


class LossMatchError(ValueError):
    """Bad input: the message names the variable and what is allowed."""


# ------------------------------------------------------------------------------------------------
# the knobs, checked before anything is written
# ------------------------------------------------------------------------------------------------
def _whole(name: str, value, low: int = 1) -> int:
    text = str(value).strip()
    if not re.fullmatch(r"[0-9]+", text) or int(text) < low:
        raise LossMatchError(f"{name}={value!r}: must be a whole number >= {low}")
    return int(text)


def parse_arms(text: str) -> List[str]:
    names = [n.strip() for n in str(text).split(",") if n.strip()]
    if not names:
        raise LossMatchError(f"ARMS={text!r}: no arm; allowed: a comma list of {', '.join(ARMS)}")
    for n in names:
        if n not in ARMS:
            raise LossMatchError(f"ARMS={text!r}: unknown arm {n!r}; allowed: a comma list of "
                                 f"{', '.join(ARMS)}")
    if len(set(names)) != len(names):
        raise LossMatchError(f"ARMS={text!r}: an arm named twice")
    if REFERENCE not in names:
        raise LossMatchError(f"ARMS={text!r}: the reference arm {REFERENCE!r} must be one of them "
                             "(every other arm is compared with it)")
    if len(names) < 2:
        raise LossMatchError(f"ARMS={text!r}: nothing to compare; add fused and/or control")
    return sorted(names, key=ARMS.index)  # the reference first, then fused, then the control


def parse_fused(text: Optional[str]) -> List[str]:
    """FUSED_FLAGS: the fusions of the ``fused`` arm, a comma list of ``FUSION_FLAGS`` names
    (without the dashes); empty or None: all six. A subset bisects which fusion moves the curve."""
    if not text or not text.strip():
        return list(FUSION_FLAGS)
    names = [x.strip().lstrip("-") for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in FUSION_FLAGS]
    if bad or len(set(names)) != len(names):
        raise LossMatchError(f"FUSED_FLAGS={text!r}: allowed a comma list of distinct "
                             f"{', '.join(FUSION_FLAGS)}")
    return names


def check(arms: str, iters, mb, gb, control_mb, last=30, tol=1.0,
          fused: Optional[str] = None) -> dict:
    """Every knob, or LossMatchError naming the first bad one."""
    names = parse_arms(arms)
    fused_flags = parse_fused(fused)
    iters = _whole("ITERS", iters)
    mb = _whole("MB", mb)
    gb = _whole("GB", gb)
    control_mb = _whole("CONTROL_MB", control_mb)
    last = _whole("LAST", last)
    try:
        tol_f = float(tol)
    except ValueError:
        tol_f = float("nan")
    if not (tol_f > 0 and math.isfinite(tol_f)):
        raise LossMatchError(f"NOISE_TOL={tol!r}: must be a positive number (1.0: the fused "
                             "difference at most the control's)")
    if gb % mb:
        raise LossMatchError(f"GB={gb}: not a multiple of MB={mb} (one GPU: GB = MB x "
                             "accumulation steps)")
    if "control" in names:
        if gb % control_mb:
            raise LossMatchError(f"GB={gb}: not a multiple of CONTROL_MB={control_mb}")
        if control_mb == mb:
            raise LossMatchError(f"CONTROL_MB={control_mb}: equals MB; the control needs another "
                                 "micro-batch split (e.g. MB/2)")
    return {"arms": names, "iters": iters, "mb": mb, "gb": gb, "control_mb": control_mb,
            "last": last, "tol": tol_f, "fused_flags": fused_flags}


# ------------------------------------------------------------------------------------------------
# the plan: one trainer config for every arm, and each arm's own flags
# ------------------------------------------------------------------------------------------------
def recipe_path(recipe: str) -> str:
    path = recipe if os.path.isfile(recipe) else os.path.join(ROOT, "recipes", recipe + ".yaml")
    if not os.path.isfile(path):
        raise LossMatchError(f"RECIPE={recipe!r}: no recipes/{recipe}.yaml and no such file")
    return path


def base_config(recipe: str, data: str, k: dict, work: str, dry: bool) -> dict:
    """The recipe as a short run: its data, checkpoint, logging and schedule-length keys dropped
    (bench_train's list), the docs data, ITERS iterations of GB sequences, warm-up ITERS/10,
    cosine to min-lr over the run, no evaluation, no checkpoint, every iteration logged."""
    import yaml  # noqa: PLC0415

    with open(recipe_path(recipe), encoding="utf-8") as f:
        c = yaml.safe_load(f) or {}
    for key in DROPPED_KEYS + ("split", "data-cache-path"):
        c.pop(key, None)
    if dry:
        c.update(DRY_SHAPE)
    c.update({"data-path": [data], "split": "98,2,0",
              "data-cache-path": os.path.join(work, "cache"),
              "train-iters": k["iters"], "global-batch-size": k["gb"], "micro-batch-size": k["mb"],
              "lr-warmup-iters": max(1, k["iters"] // 10), "eval-iters": 0,
              "eval-interval": 10 ** 9, "log-interval": 1})
    return c


def arm_flags(arm: str, k: dict) -> List[str]:
    if arm == "fused":
        return ["--" + f for f in k.get("fused_flags", FUSION_FLAGS)]
    if arm == "control":
        return ["--micro-batch-size", str(k["control_mb"])]
    return []


def plan(k: dict, recipe: str, data: str, work: str, dry: bool) -> None:
    import yaml  # noqa: PLC0415

    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "base.yaml"), "w", encoding="utf-8") as f:
        f.write(f"# tools/loss_match.py plan: {recipe}{' (DRY shape)' if dry else ''}, "
                f"{k['iters']} iterations x {k['gb']} sequences\n")
        yaml.safe_dump(base_config(recipe, data, k, work, dry), f, sort_keys=False)
    with open(os.path.join(work, "arms.tsv"), "w", encoding="utf-8") as f:
        for arm in k["arms"]:
            f.write(arm + "\t" + " ".join(arm_flags(arm, k)) + "\n")
    with open(os.path.join(work, "knobs.json"), "w", encoding="utf-8") as f:
        json.dump({**k, "recipe": recipe, "data": data, "dry": dry}, f, indent=1)


# ------------------------------------------------------------------------------------------------
# the comparison
# ------------------------------------------------------------------------------------------------
def read_metrics(path: str) -> Dict[int, dict]:
    """{iteration: record} of a metrics file (records with lm_loss, None included: a skipped
    iteration; a later line wins); {} when the arm wrote none."""
    if not os.path.isfile(path):
        return {}
    return read_records(path, lambda rec: "lm_loss" in rec)


def _loss(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")  # a skipped iteration logs None


def diff_stats(ref: Dict[int, float], other: Dict[int, float], its: List[int], last: int) -> dict:
    """other - ref over ``its``: max abs (and where), mean abs, mean signed, mean abs of the
    last ``last`` iterations; a non-finite loss is an infinite difference."""
    if not its:
        return {"iterations": 0}
    d = {}
    for i in its:
        a, b = ref[i], other[i]
        d[i] = b - a if math.isfinite(a) and math.isfinite(b) else float("inf")
    absd = {i: abs(v) for i, v in d.items()}
    worst = max(its, key=lambda i: absd[i])
    tail = its[-last:]
    return {"iterations": len(its), "first": its[0], "last": its[-1],
            "max_abs": absd[worst], "max_abs_iteration": worst,
            "mean_abs": sum(absd.values()) / len(its),
            "mean_signed": sum(d.values()) / len(its),
            "last_window": len(tail), "last_mean_abs": sum(absd[i] for i in tail) / len(tail),
            "first_iteration_abs": absd[its[0]],
            "nonfinite": sorted(i for i in its if not math.isfinite(d[i]))}


def _ratio(a: float, b: float) -> float:
    if a == 0:
        return 0.0
    return a / b if b > 0 else float("inf")


def verdict(fused: Optional[dict], control: Optional[dict], tol: float) -> dict:
    """The rule of the module docstring."""
    if not fused or not fused.get("iterations"):
        return {"verdict": "no verdict", "why": "no fused losses on iterations all arms reached"}
    if not control or not control.get("iterations"):
        return {"verdict": "no verdict", "why": "no bf16-noise control on iterations all arms "
                "reached (ARMS without control, or it did not run)"}
    r_max = _ratio(fused["max_abs"], control["max_abs"])
    r_mean = _ratio(fused["mean_abs"], control["mean_abs"])
    ok = r_max <= tol and r_mean <= tol
    return {"verdict": "within bf16 noise" if ok else "larger than bf16 noise",
            "ratio_max_abs": r_max, "ratio_mean_abs": r_mean, "tol": tol,
            "rule": f"fused max_abs <= {tol:g} x control max_abs and fused mean_abs <= {tol:g} x "
                    "control mean_abs (differences from unfused over the iterations all arms "
                    "reached)"}


def step_ms(rows: Dict[int, dict], skip: int) -> Optional[float]:
    """Mean iteration time (ms) after the first ``skip`` iterations (start-up, compilation)."""
    times = [r["time_s"] for i, r in sorted(rows.items()) if i > skip and "time_s" in r]
    return 1000 * sum(times) / len(times) if times else None


def compare(work: str, arms: List[str], iters: int, last: int, tol: float) -> dict:
    metrics = {a: read_metrics(os.path.join(work, a + ".jsonl")) for a in arms}
    losses = {a: {i: _loss(r["lm_loss"]) for i, r in m.items()} for a, m in metrics.items()}
    common = sorted(set.intersection(*(set(v) for v in losses.values()))) if losses else []
    pairs = {a: diff_stats(losses[REFERENCE], losses[a], common, last)
             for a in arms if a != REFERENCE}
    skip = min(5, max(0, iters // 10))
    per_arm = {a: {"iterations": len(losses[a]), "planned": iters,
                   "last_loss": losses[a][max(losses[a])] if losses[a] else None,
                   "step_ms_after_warmup": step_ms(metrics[a], skip),
                   "description": DESCRIPTION[a]} for a in arms}
    v = verdict(pairs.get("fused"), pairs.get("control"), tol)
    return {"tool": "tools/loss_match.py", "reference": REFERENCE, "arms": per_arm,
            "common_iterations": len(common), "planned_iterations": iters,
            "step_ms_skips_first": skip, "comparisons": pairs, **v}


def _f(x, fmt=".3e") -> str:
    if x is None:
        return "-"
    return format(x, fmt) if math.isfinite(x) else str(x)


def markdown(report: dict, knobs: dict) -> str:
    lines = ["## Loss match: fused vs unfused, against a bf16-noise control (issue 21)", ""]
    if knobs:
        dry = " (DRY: tiny CPU shape)" if knobs.get("dry") else ""
        lines.append(f"Recipe {knobs.get('recipe')}{dry}"
                     f", {knobs.get('iters')} iterations x global batch {knobs.get('gb')}, "
                     f"micro-batch {knobs.get('mb')} (control {knobs.get('control_mb')}), "
                     f"data {knobs.get('data')}.")
        lines.append("")
    lines += [f"**Verdict: {report['verdict']}**"
              + (f" ({report['why']})" if report.get("why") else
                 f": fused/control max abs {report['ratio_max_abs']:.2f}x, mean abs "
                 f"{report['ratio_mean_abs']:.2f}x (rule: {report['rule']})"), "",
              f"Compared over the {report['common_iterations']} iterations every arm reached "
              f"(of {report['planned_iterations']} planned).", "",
              "| arm | iterations | last loss | step ms (after it. "
              f"{report['step_ms_skips_first']}) | what |", "|---|---|---|---|---|"]
    for name, a in report["arms"].items():
        lines.append(f"| {name} | {a['iterations']} | {_f(a['last_loss'], '.4f')} | "
                     f"{_f(a['step_ms_after_warmup'], '.1f')} | {a['description']} |")
    lines += ["", "| vs unfused | max abs (iteration) | mean abs | mean abs, last N | "
              "mean signed | iteration 1 abs |", "|---|---|---|---|---|---|"]
    for name, s in report["comparisons"].items():
        if not s.get("iterations"):
            lines.append(f"| {name} | no common iterations | | | | |")
            continue
        lines.append(f"| {name} | {_f(s['max_abs'])} ({s['max_abs_iteration']}) | "
                     f"{_f(s['mean_abs'])} | {_f(s['last_mean_abs'])} (N={s['last_window']}) | "
                     f"{_f(s['mean_signed'], '+.3e')} | {_f(s['first_iteration_abs'])} |")
        if s["nonfinite"]:
            lines.append(f"|  | non-finite loss at iterations {s['nonfinite'][:10]} | | | | |")
    return "\n".join(lines) + "\n"


def plot(work: str, arms: List[str], path: str, title: str) -> bool:
    """tools/plot_losses.py's two panels (loss; arm - unfused), the arms that logged anything."""
    import plot_losses  # noqa: PLC0415

    files = [(a, os.path.join(work, a + ".jsonl")) for a in arms]
    files = [(a, f) for a, f in files if os.path.isfile(f) and plot_losses.read_losses(f)]
    if not files or files[0][0] != REFERENCE:
        return False
    plot_losses.main([f for _, f in files] + ["--labels", *[a for a, _ in files], "--title",
                                              title, "--output", path])
    return True


# ------------------------------------------------------------------------------------------------
# the command line
# ------------------------------------------------------------------------------------------------
def _knob_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arms", default=",".join(ARMS), help="ARMS (default unfused,fused,control)")
    p.add_argument("--iters", default="50", help="ITERS")
    p.add_argument("--mb", default="8", help="MB")
    p.add_argument("--gb", default="16", help="GB")
    p.add_argument("--control-mb", default="4", help="CONTROL_MB")
    p.add_argument("--last", default="30", help="LAST")
    p.add_argument("--tol", default="1.0", help="NOISE_TOL")
    p.add_argument("--fused-flags", default="", help="FUSED_FLAGS (default: all six fusions)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="validate the knobs; write nothing")
    _knob_args(c)
    pl = sub.add_parser("plan", help="WORK/base.yaml, WORK/arms.tsv, WORK/knobs.json")
    _knob_args(pl)
    pl.add_argument("--work", required=True)
    pl.add_argument("--data", required=True, help="the preprocessed prefix (..._text_document)")
    pl.add_argument("--recipe", default="transformer-pp-1.3b-100b")
    pl.add_argument("--dry", action="store_true", help="the tiny CPU shape")
    cm = sub.add_parser("compare", help="WORK/ARM.jsonl -> JSON, markdown, plot")
    cm.add_argument("--work", required=True)
    cm.add_argument("--json", required=True)
    cm.add_argument("--md", required=True)
    cm.add_argument("--plot", default=None, help="a .png (matplotlib)")
    args = p.parse_args(argv)
    try:
        if args.cmd == "check":
            print(json.dumps(check(args.arms, args.iters, args.mb, args.gb, args.control_mb,
                                   args.last, args.tol, args.fused_flags)))
            return 0
        if args.cmd == "plan":
            k = check(args.arms, args.iters, args.mb, args.gb, args.control_mb, args.last,
                      args.tol, args.fused_flags)
            recipe_path(args.recipe)
            plan(k, args.recipe, args.data, args.work, args.dry)
            return 0
    except LossMatchError as e:
        print(f"loss_match: {e}", file=sys.stderr)
        return 2
    knobs_file = os.path.join(args.work, "knobs.json")
    if not os.path.isfile(knobs_file):
        print(f"loss_match: --work {args.work}: no knobs.json (run plan first)", file=sys.stderr)
        return 2
    with open(knobs_file, encoding="utf-8") as f:
        knobs = json.load(f)
    report = compare(args.work, knobs["arms"], knobs["iters"], knobs["last"], knobs["tol"])
    if "fused" in report["arms"]:  # the fusions this run's fused arm had (FUSED_FLAGS)
        report["arms"]["fused"]["description"] = "unfused + " + " ".join(
            "--" + f for f in knobs.get("fused_flags", FUSION_FLAGS))
    report["knobs"] = knobs
    if args.plot:
        try:
            report["plot"] = os.path.basename(args.plot) if plot(
                args.work, knobs["arms"], args.plot,
                f"{knobs['recipe']}: fused and control vs unfused") else None
        except Exception as e:  # noqa: BLE001 - the numbers matter more than the figure
            report["plot"] = None
            report["plot_error"] = f"{type(e).__name__}: {e}"
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    text = markdown(report, knobs)
    with open(args.md, "w", encoding="utf-8") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
