"""Issue 21's loss-curve check: does the fused path change the math, and which fusion moves the
curve? The logic behind tools/gpu_loss_match.sh (which runs the arms on one GPU and calls this
file's subcommands).

    python tools/loss_match.py check --arms unfused,control,fused,fused-each --iters 40 \\
        --warmup 20 --mb 8 --gb 16 --control-mb 4       # validate only, write nothing
    python tools/loss_match.py plan --work W --data PREFIX ...   # W/base.yaml, W/arms.tsv
    python tools/loss_match.py compare --work W --json J --md M --plot P

Arms (``ARMS``, a comma list; the reference ``unfused`` must be one of them):

* ``unfused``: the recipe as it is (the default local path), micro-batch MB, global batch GB;
* ``control-sdpa``: ``unfused`` with ``--subq-sdpa-backend flash`` (torch's FlashAttention-2
  instead of cuDNN's SDPA): the same math through another kernel, so bf16 rounding changes inside
  every layer's forward and backward, as a fusion's does: the bf16-noise yardstick, and the one
  the verdicts use when it ran;
* ``control``: ``unfused`` at micro-batch CONTROL_MB (same global batch, so more accumulation
  steps): the forward bitwise the same, only the fp32 gradient sums reordered (the control of
  issue 25's hybrid comparison, docs/results.md). A smaller perturbation than bf16 rounding: on
  an H200 (2026-11-27) each fusion alone, and torch's fused AdamW (fp32-level changes) at 0.45x,
  set it apart; the verdicts use it only without ``control-sdpa``;
* ``fused``: unfused plus the six fusions that run without TE/apex (``bench_train.FUSION_FLAGS``,
  the ``ours-fused`` arm of tools/gpu_train_bench.sh), or the subset FUSED_FLAGS;
* ``fused-<fusion>`` for each fusion of FUSION_FLAGS (``fused-subq-fused-norm``, ...,
  ``fused-subq-fused-adam``): unfused plus that one flag; ``fused-each`` names all six. One run
  with ``unfused,control,fused-each`` bisects which fusion moves the curve against one reference
  and one control.

They run in that order whatever the order in ARMS (unfused, control-sdpa, control, fused, then the
single-fusion arms in FUSION_FLAGS order), so the reference and the yardsticks exist even when the
clock cuts the last arms. Every arm has the same seed, data, global batch and schedule (ITERS
iterations, WARMUP (ITERS/10, at least 1) of linear warm-up, cosine decay over the rest), so the
same samples in the same order (megatron's sampler walks the dataset in global batches; the split
into micro-batches does not reorder them). A longer WARMUP than the 1.3B recipe's 5 iterations of
a 50-iteration run matters: that warm-up is unstable (grad norm up to 258), which amplifies
rounding differences.

The comparison (``compare``) reads each arm's metrics file (``WORK/ARM.jsonl``: the trainer's
``--metrics-file``, one line per iteration with ``lm_loss``; a later line of an iteration wins)
and gives every other arm its differences from ``unfused`` over the iterations that arm, unfused
and the control all reached (without the control's losses: that arm and unfused), so a run
stopped at the deadline is compared on what it reached and a cut or failed last arm leaves the
others alone: ``max_abs`` (and its iteration), ``mean_abs``, ``mean_signed`` (arm - unfused),
``last_mean_abs`` (mean abs over the last LAST (30) of those iterations, all of them when fewer).
A non-finite loss in that range counts as an infinite difference.

The rule (a verdict for each fused-type arm: ``fused`` and every ``fused-<fusion>``): **within
bf16 noise** when the arm's ``max_abs`` and ``mean_abs`` are each at most NOISE_TOL (1.0) times
the yardstick's (``control-sdpa``, else ``control``: ``noise_arm``) over the same iterations (the
arm's); otherwise **larger than bf16 noise** (the
ratios say by how much). Without the control's or the arm's losses on those iterations the
verdict is **no verdict** (and says why). The report's ``verdicts`` holds one per fused-type arm;
its top-level ``verdict`` is the ``fused`` arm's (no verdict when ARMS has none).
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

# the six fusions that run without TE/apex: gpu_train_bench.sh's ours-fused arm (bench_train.py
# imports torch only inside its functions)
from bench_train import DROPPED_KEYS, FUSION_FLAGS  # noqa: E402
from plot_losses import read_records  # noqa: E402

REFERENCE = "unfused"
SINGLE = tuple("fused-" + f for f in FUSION_FLAGS)  # one fusion each
EACH = "fused-each"  # shorthand for every SINGLE arm
SDPA_CONTROL = "control-sdpa"  # unfused through another SDPA kernel: the bf16-rounding yardstick
SDPA_CONTROL_BACKEND = "flash"  # the recipe's attention runs cuDNN's SDPA by default on Hopper
ARMS = ("unfused", SDPA_CONTROL, "control", "fused") + SINGLE  # the run order
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


def is_fused(arm: str) -> bool:
    """``fused`` and the single-fusion arms: the arms that get a verdict."""
    return arm == "fused" or arm in SINGLE


def parse_arms(text: str) -> List[str]:
    """ARMS: a comma list of ARMS' names and ``fused-each`` (all of SINGLE), returned in the run
    order of ARMS (the reference, the controls, fused, the single-fusion arms)."""
    allowed = f"allowed: a comma list of {', '.join(ARMS[:4] + (EACH,) + SINGLE)}"
    given = [n.strip() for n in str(text).split(",") if n.strip()]
    if not given:
        raise LossMatchError(f"ARMS={text!r}: no arm; {allowed}")
    names = []
    for n in given:
        if n != EACH and n not in ARMS:
            raise LossMatchError(f"ARMS={text!r}: unknown arm {n!r}; {allowed}")
        names += list(SINGLE) if n == EACH else [n]
    twice = sorted({n for n in names if names.count(n) > 1}, key=ARMS.index)
    if twice:
        raise LossMatchError(f"ARMS={text!r}: arm {twice[0]!r} named twice"
                             + (f" ({EACH} names every fused-<fusion> arm)" if EACH in given
                                else ""))
    if REFERENCE not in names:
        raise LossMatchError(f"ARMS={text!r}: the reference arm {REFERENCE!r} must be one of them "
                             "(every other arm is compared with it)")
    if len(names) < 2:
        raise LossMatchError(f"ARMS={text!r}: nothing to compare; add control and fused arms")
    return sorted(names, key=ARMS.index)


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


def parse_warmup(value, iters: int) -> int:
    """WARMUP: the linear warm-up in iterations, a whole number below ITERS (the cosine decay
    needs the rest); empty or None: ITERS/10, at least 1 (the recipe's own is in samples)."""
    if value is None or not str(value).strip():
        return max(1, iters // 10)
    warmup = _whole("WARMUP", value, low=0)
    if warmup >= iters:
        raise LossMatchError(f"WARMUP={value!r}: must be less than ITERS={iters}")
    return warmup


def check(arms: str, iters, mb, gb, control_mb, last=30, tol=1.0,
          fused: Optional[str] = None, warmup=None) -> dict:
    """Every knob, or LossMatchError naming the first bad one."""
    names = parse_arms(arms)
    fused_flags = parse_fused(fused)
    iters = _whole("ITERS", iters)
    warmup = parse_warmup(warmup, iters)
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
    return {"arms": names, "iters": iters, "warmup": warmup, "mb": mb, "gb": gb,
            "control_mb": control_mb, "last": last, "tol": tol_f, "fused_flags": fused_flags}


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
    (bench_train's list), the docs data, ITERS iterations of GB sequences, warm-up WARMUP,
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
              "lr-warmup-iters": k["warmup"], "eval-iters": 0,
              "eval-interval": 10 ** 9, "log-interval": 1})
    return c


def fusions(arm: str, fused_flags=FUSION_FLAGS) -> List[str]:
    """The fusions a fused-type arm adds to unfused (``fused``: FUSED_FLAGS); [] for the others."""
    if arm == "fused":
        return list(fused_flags)
    return [arm[len("fused-"):]] if arm in SINGLE else []


def noise_arm(arms) -> str:
    """The yardstick of the verdicts: ``control-sdpa`` when it is one of ``arms`` (a change of
    bf16 rounding inside the forward and backward, as a fusion's is), else ``control`` (micro-batch
    split: the forward bitwise the same, only the fp32 gradient sums reordered: a smaller
    perturbation than any fusion's, measured 2026-11-27, docs/benchmarks.md)."""
    return SDPA_CONTROL if SDPA_CONTROL in arms else "control"


def arm_flags(arm: str, k: dict) -> List[str]:
    if arm == SDPA_CONTROL:
        return ["--subq-sdpa-backend", SDPA_CONTROL_BACKEND]
    if arm == "control":
        return ["--micro-batch-size", str(k["control_mb"])]
    return ["--" + f for f in fusions(arm, k.get("fused_flags", FUSION_FLAGS))]


def describe(arm: str, fused_flags=FUSION_FLAGS) -> str:
    if arm == REFERENCE:
        return "the recipe's default local path"
    if arm == "control":
        return ("unfused at micro-batch CONTROL_MB (same global batch): an fp32-summation-order "
                "yardstick")
    if arm == SDPA_CONTROL:
        return (f"unfused with --subq-sdpa-backend {SDPA_CONTROL_BACKEND} (the same attention "
                "math through another kernel): the bf16-rounding yardstick")
    return "unfused + " + " ".join("--" + f for f in fusions(arm, fused_flags))


def plan(k: dict, recipe: str, data: str, work: str, dry: bool) -> None:
    import yaml  # noqa: PLC0415

    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "base.yaml"), "w", encoding="utf-8") as f:
        f.write(f"# tools/loss_match.py plan: {recipe}{' (DRY shape)' if dry else ''}, "
                f"{k['iters']} iterations (warm-up {k['warmup']}) x {k['gb']} sequences\n")
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
    """The rule of the module docstring: ``fused`` and ``control`` are one fused-type arm's and
    the control's diff_stats over the same iterations."""
    if not fused or not fused.get("iterations"):
        return {"verdict": "no verdict", "why": "no losses of this arm on iterations unfused "
                "and the control reached"}
    if not control or not control.get("iterations"):
        return {"verdict": "no verdict", "why": "no bf16-noise control on this arm's iterations "
                "(ARMS without control, or it did not run)"}
    r_max = _ratio(fused["max_abs"], control["max_abs"])
    r_mean = _ratio(fused["mean_abs"], control["mean_abs"])
    ok = r_max <= tol and r_mean <= tol
    return {"verdict": "within bf16 noise" if ok else "larger than bf16 noise",
            "ratio_max_abs": r_max, "ratio_mean_abs": r_mean, "tol": tol,
            "iterations": fused["iterations"],
            "rule": f"arm max_abs <= {tol:g} x control max_abs and arm mean_abs <= {tol:g} x "
                    "control mean_abs (differences from unfused over the iterations the arm, "
                    "unfused and the control all reached)"}


def step_ms(rows: Dict[int, dict], skip: int) -> Optional[float]:
    """Mean iteration time (ms) after the first ``skip`` iterations (start-up, compilation)."""
    times = [r["time_s"] for i, r in sorted(rows.items()) if i > skip and "time_s" in r]
    return 1000 * sum(times) / len(times) if times else None


def compare(work: str, arms: List[str], iters: int, last: int, tol: float,
            fused_flags=FUSION_FLAGS) -> dict:
    """Each arm's stats vs unfused and each fused-type arm's verdict (the module docstring);
    ``fused_flags``: the fused arm's fusions, for its description."""
    metrics = {a: read_metrics(os.path.join(work, a + ".jsonl")) for a in arms}
    losses = {a: {i: _loss(r["lm_loss"]) for i, r in m.items()} for a, m in metrics.items()}
    common = sorted(set.intersection(*(set(v) for v in losses.values()))) if losses else []
    noise_name = noise_arm(arms)
    ref, ctrl = losses[REFERENCE], losses.get(noise_name) or {}
    pairs, verdicts = {}, {}
    for a in arms:
        if a == REFERENCE:
            continue
        its = set(ref) & set(losses[a]) & (set(ctrl) if ctrl else set(losses[a]))
        pairs[a] = diff_stats(ref, losses[a], sorted(its), last)
        if is_fused(a):
            noise = diff_stats(ref, ctrl, sorted(its), last) if ctrl else None
            verdicts[a] = verdict(pairs[a], noise, tol)
    skip = min(5, max(0, iters // 10))
    per_arm = {a: {"iterations": len(losses[a]), "planned": iters,
                   "last_loss": losses[a][max(losses[a])] if losses[a] else None,
                   "step_ms_after_warmup": step_ms(metrics[a], skip),
                   "description": describe(a, fused_flags)} for a in arms}
    top = verdicts.get("fused") or {"verdict": "no verdict", "why": "no fused arm in ARMS" + (
        " (each fused-<fusion> arm's verdict is in verdicts)" if verdicts else "")}
    return {"tool": "tools/loss_match.py", "reference": REFERENCE, "noise_arm": noise_name,
            "arms": per_arm,
            "common_iterations": len(common), "planned_iterations": iters,
            "step_ms_skips_first": skip, "comparisons": pairs, "verdicts": verdicts, **top}


def _f(x, fmt=".3e") -> str:
    if x is None:
        return "-"
    return format(x, fmt) if math.isfinite(x) else str(x)


def _judged(v: dict) -> str:
    return f" ({v['why']})" if v.get("why") else (
        f": arm/control max abs {v['ratio_max_abs']:.2f}x, mean abs {v['ratio_mean_abs']:.2f}x "
        f"over {v['iterations']} iterations")


def markdown(report: dict, knobs: dict) -> str:
    """The summary: the top verdict line (the fused arm's; left out when ARMS has single-fusion
    arms but no fused arm), a verdict table of every fused-type arm when ARMS has single-fusion
    arms, the arms, each arm's differences from unfused."""
    lines = ["## Loss match: fused arms vs unfused, against a bf16-noise control (issue 21)", ""]
    if knobs:
        dry = " (DRY: tiny CPU shape)" if knobs.get("dry") else ""
        lines.append(f"Recipe {knobs.get('recipe')}{dry}"
                     f", {knobs.get('iters')} iterations (warm-up {knobs.get('warmup')}) x global "
                     f"batch {knobs.get('gb')}, micro-batch {knobs.get('mb')} (control "
                     f"{knobs.get('control_mb')}), data {knobs.get('data')}.")
        lines.append("")
    verdicts = report.get("verdicts", {})
    single = any(a in SINGLE for a in verdicts)
    if "fused" in verdicts or not single:
        lines += [f"**Verdict: {report['verdict']}**" + _judged(report), ""]
    if single:
        lines += [f"| fused arm | verdict vs {report.get('noise_arm', 'control')} |", "|---|---|"]
        lines += [f"| {a} | **{v['verdict']}**{_judged(v)} |" for a, v in verdicts.items()]
        lines.append("")
    rule = next((v["rule"] for v in verdicts.values() if "rule" in v), None)
    lines += ([f"Rule: {rule}.", ""] if rule else []) + [
              f"{report['common_iterations']} of {report['planned_iterations']} planned "
              "iterations reached by every arm; each arm is compared with unfused over the "
              "iterations it, unfused and the control reached (column iterations).", "",
              "| arm | iterations | last loss | step ms (after it. "
              f"{report['step_ms_skips_first']}) | what |", "|---|---|---|---|---|"]
    for name, a in report["arms"].items():
        lines.append(f"| {name} | {a['iterations']} | {_f(a['last_loss'], '.4f')} | "
                     f"{_f(a['step_ms_after_warmup'], '.1f')} | {a['description']} |")
    lines += ["", "| vs unfused | iterations | max abs (iteration) | mean abs | mean abs, last N | "
              "mean signed | first iteration abs |", "|---|---|---|---|---|---|---|"]
    for name, s in report["comparisons"].items():
        if not s.get("iterations"):
            lines.append(f"| {name} | no common iterations | | | | | |")
            continue
        lines.append(f"| {name} | {s['first']}-{s['last']} ({s['iterations']}) | "
                     f"{_f(s['max_abs'])} ({s['max_abs_iteration']}) | "
                     f"{_f(s['mean_abs'])} | {_f(s['last_mean_abs'])} (N={s['last_window']}) | "
                     f"{_f(s['mean_signed'], '+.3e')} | {_f(s['first_iteration_abs'])} |")
        if s["nonfinite"]:
            lines.append(f"|  | non-finite loss at iterations {s['nonfinite'][:10]} | | | | | |")
    return "\n".join(lines) + "\n"


def plot(work: str, arms: List[str], path: str, title: str) -> bool:
    """tools/plot_losses.py's two panels (loss; arm - unfused), every arm that logged anything."""
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
    p.add_argument("--arms", default="unfused,fused,control",
                   help=f"ARMS (default unfused,fused,control; also {EACH} and fused-<fusion>)")
    p.add_argument("--iters", default="50", help="ITERS")
    p.add_argument("--warmup", default="", help="WARMUP (default ITERS/10, at least 1)")
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
                                   args.last, args.tol, args.fused_flags, args.warmup)))
            return 0
        if args.cmd == "plan":
            k = check(args.arms, args.iters, args.mb, args.gb, args.control_mb, args.last,
                      args.tol, args.fused_flags, args.warmup)
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
    report = compare(args.work, knobs["arms"], knobs["iters"], knobs["last"], knobs["tol"],
                     knobs.get("fused_flags", FUSION_FLAGS))
    report["knobs"] = knobs
    if args.plot:
        try:
            report["plot"] = os.path.basename(args.plot) if plot(
                args.work, knobs["arms"], args.plot,
                f"{knobs['recipe']}: every arm vs unfused") else None
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
