"""The study of docs/study.md: several arms trained on the same data, order and token budget,
then their validation curves side by side.

    python tools/study.py run recipes/study/lm-125m.yaml --out runs/study/lm-125m [--arms a,b]
    python tools/study.py plot runs/study/lm-125m [more run folders] --output loss.png

A study file holds ``base`` (trainer flags shared by every arm: model, data, split, seed,
schedule, token budget) and ``arms`` (name -> the flags that differ: the attention variant and
its knobs; a per-arm ``micro-batch-size`` changes only how the global batch is accumulated).
Optional ``stages`` (list of flag sets) train each arm in stages, each resuming from the previous
stage's checkpoint with a fresh data iterator and its own schedule (``--finetune``: weights
only). ``run`` trains the arms one after another through examples/pretrain_gpt.py, writing per
arm its effective config, log and metrics JSONL, and ``summary.json`` (tokens, wall time,
tokens/s, final validation loss, GPU). ``plot`` draws validation loss against tokens for every
arm of the given folders (and the training loss, smoothed) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Dict, List

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_study(path: str) -> dict:
    """The study file, checked: ``base`` a mapping, ``arms`` a non-empty mapping of mappings,
    ``stages`` (optional) a non-empty list of mappings."""
    with open(path, encoding="utf-8") as f:
        study = yaml.safe_load(f)
    if not isinstance(study, dict) or not isinstance(study.get("base"), dict):
        raise ValueError(f"{path}: a study file needs a 'base' mapping of trainer flags")
    arms = study.get("arms")
    if not isinstance(arms, dict) or not arms or not all(isinstance(v, dict) for v in
                                                         arms.values()):
        raise ValueError(f"{path}: 'arms' must map each arm's name to its trainer flags")
    stages = study.get("stages", [{}])
    if not isinstance(stages, list) or not stages or not all(isinstance(s, dict) for s in stages):
        raise ValueError(f"{path}: 'stages' must be a non-empty list of flag mappings")
    study["stages"] = stages
    return study


def arm_configs(study: dict, arm: str, out: str) -> List[dict]:
    """The effective trainer config of every stage of ``arm`` (base, then the arm's flags, then
    the stage's; later stages load the previous stage's save)."""
    configs = []
    for k, stage in enumerate(study["stages"]):
        cfg = dict(study["base"])
        cfg.update(study["arms"][arm])
        cfg.update(stage)
        tag = arm if len(study["stages"]) == 1 else f"{arm}.stage{k + 1}"
        cfg["metrics-file"] = os.path.join(out, f"{tag}.jsonl")
        if len(study["stages"]) > 1 or cfg.get("save"):
            cfg["save"] = os.path.join(out, "ckpt", tag)
        if k > 0:
            cfg["load"] = configs[-1]["save"]
            cfg["finetune"] = True
        configs.append(cfg)
    return configs


def gpu_name() -> str:
    try:
        import torch  # noqa: PLC0415

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001
        return "unknown"


def read_metrics(path: str):
    """(training rows, validation rows) of a metrics JSONL."""
    train, valid = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            (valid if "valid_loss" in row else train).append(row)
    return train, valid


def run(args) -> int:
    study = read_study(args.study)
    arms = list(study["arms"]) if not args.arms else args.arms.split(",")
    unknown = [a for a in arms if a not in study["arms"]]
    if unknown:
        raise SystemExit(f"--arms: unknown arm(s) {unknown}; the study has {list(study['arms'])}")
    os.makedirs(args.out, exist_ok=True)
    summary_path = os.path.join(args.out, "summary.json")
    summary = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
    failed = []
    for arm in arms:
        for k, cfg in enumerate(arm_configs(study, arm, args.out)):
            tag = os.path.basename(cfg["metrics-file"])[:-len(".jsonl")]
            cfg_path = os.path.join(args.out, f"{tag}.yaml")
            with open(cfg_path, "w", encoding="utf-8") as f:
                yaml.safe_dump(cfg, f, sort_keys=False)
            if os.path.exists(cfg["metrics-file"]):
                os.remove(cfg["metrics-file"])
            cmd = [sys.executable, os.path.join(ROOT, "examples", "pretrain_gpt.py"),
                   "--config", cfg_path]
            print(f"== {tag}: {' '.join(cmd)}", flush=True)
            start = time.time()
            with open(os.path.join(args.out, f"{tag}.log"), "w", encoding="utf-8") as log:
                rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
            wall = time.time() - start
            train, valid = read_metrics(cfg["metrics-file"]) if os.path.exists(
                cfg["metrics-file"]) else ([], [])
            seq, gbs = int(cfg["seq-length"]), int(cfg["global-batch-size"])
            steady = [r["tokens_per_sec_per_gpu"] for r in train[len(train) // 10 + 2:]]
            summary[tag] = {
                "exit": rc, "wall_s": round(wall, 1), "gpu": gpu_name(),
                "iterations": train[-1]["iteration"] if train else 0,
                "tokens": (train[-1]["iteration"] if train else 0) * gbs * seq,
                "tokens_per_s": round(sum(steady) / len(steady)) if steady else None,
                "final_valid_loss": valid[-1]["valid_loss"] if valid else None,
                "final_train_loss": train[-1]["lm_loss"] if train else None,
                "flags": {**study["arms"][arm], **study["stages"][k]}}
            print(json.dumps({tag: summary[tag]}), flush=True)
            with open(summary_path + ".tmp", "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=1)
            os.replace(summary_path + ".tmp", summary_path)
            if rc != 0:
                print(f"{tag} failed (exit {rc}); its log: {args.out}/{tag}.log", flush=True)
                os.system(f"tail -30 {args.out}/{tag}.log")
                failed.append(tag)
                break  # later stages of this arm need this one; the next arm still runs
    if failed:
        print(f"failed: {failed}", flush=True)
    return 1 if failed else 0


def _smooth(values: List[float], window: int) -> List[float]:
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > window:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def plot(args) -> int:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    runs: Dict[str, tuple] = {}
    for folder in args.runs:
        summary = json.load(open(os.path.join(folder, "summary.json")))
        for tag, info in summary.items():
            cfg = yaml.safe_load(open(os.path.join(folder, f"{tag}.yaml")))
            tokens_per_iter = int(cfg["seq-length"]) * int(cfg["global-batch-size"])
            train, valid = read_metrics(os.path.join(folder, f"{tag}.jsonl"))
            runs[tag] = (tokens_per_iter, train, valid, info)
    fig, (ax_v, ax_t) = plt.subplots(1, 2, figsize=(12, 4.5))
    for tag, (tpi, train, valid, _) in runs.items():
        ax_v.plot([r["iteration"] * tpi / 1e6 for r in valid], [r["valid_loss"] for r in valid],
                  marker="o", ms=3, label=tag)
        ax_t.plot([r["iteration"] * tpi / 1e6 for r in train],
                  _smooth([r["lm_loss"] for r in train], args.smooth), label=tag)
    for ax, what in ((ax_v, "validation loss (held-out documents)"),
                     (ax_t, f"training loss (mean of {args.smooth} iterations)")):
        ax.set_xlabel("tokens (millions)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend()
    if args.ylim:
        lo, hi = (float(x) for x in args.ylim.split(","))
        ax_v.set_ylim(lo, hi)
        ax_t.set_ylim(lo, hi)
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    tmp = args.output + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, args.output)
    print("| arm | tokens | final validation loss | tokens/s | wall s | GPU |")
    print("|---|---|---|---|---|---|")
    for tag, (_, _, _, info) in runs.items():
        loss = info["final_valid_loss"]
        print(f"| {tag} | {info['tokens'] / 1e6:.1f}M | {loss:.4f} | {info['tokens_per_s']} | "
              f"{info['wall_s']} | {info['gpu']} |" if loss is not None else f"| {tag} | failed |")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train the arms of a study file")
    r.add_argument("study", help="a study YAML (recipes/study/)")
    r.add_argument("--out", required=True, help="folder for configs, logs, metrics, summary")
    r.add_argument("--arms", default=None, help="comma-separated subset of the study's arms")
    q = sub.add_parser("plot", help="validation curves of finished runs")
    q.add_argument("runs", nargs="+", help="folders written by `run`")
    q.add_argument("--output", required=True, help="the PNG to write")
    q.add_argument("--smooth", type=int, default=20)
    q.add_argument("--ylim", default=None, help="lo,hi of the loss axes")
    q.add_argument("--title", default=None)
    args = p.parse_args(argv)
    return run(args) if args.command == "run" else plot(args)


if __name__ == "__main__":
    sys.exit(main())
