"""Training loss per iteration of several runs, and each run's difference from the first.

    python tools/plot_losses.py A.jsonl B.jsonl [C.jsonl ...] --labels "1 GPU" "4 GPUs" \
        --title "hybrid, 1 GPU vs TP 2 + SP, EP 2, CP 2" --output loss.png

Input: the trainer's metrics files (``--metrics-file``: one JSON object per logged iteration with
``iteration`` and ``lm_loss``). A file written by several attempts of one job (a run killed and
resumed from its checkpoint) holds the iterations since the checkpoint twice; the later attempt's
value is the one plotted, as the resumed run is the one that continued. Top panel: loss per
iteration; bottom panel: run − first run at the iterations both logged (the comparison the
multi-GPU equivalence runs of docs/results.md make). The PNG is written to a temporary name and
renamed when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def read_records(path: str, keep=lambda rec: True) -> dict:
    """{iteration: record} of a metrics file (JSON lines, the trainer's ``--metrics-file``): the
    records with an ``iteration`` that ``keep`` accepts; a later line for the same iteration wins
    (a resumed run appends); lines that are not JSON objects are skipped. The one reader of the
    tools that compare runs (this one, loss_match.py, nano_evidence.py): no torch."""
    out = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and "iteration" in rec and keep(rec):
                out[int(rec["iteration"])] = rec
    return out


def read_losses(path: str) -> dict:
    """{iteration: lm_loss} of a metrics file; a later line for the same iteration wins."""
    return {i: float(rec["lm_loss"]) for i, rec in
            read_records(path, lambda rec: rec.get("lm_loss") is not None).items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="metrics files (JSON lines); the first is the reference")
    p.add_argument("--labels", nargs="+", help="one label per file (default: the file names)")
    p.add_argument("--title", default="")
    p.add_argument("--output", required=True, help="the PNG to write")
    args = p.parse_args(argv)
    if args.labels and len(args.labels) != len(args.files):
        p.error(f"--labels: {len(args.labels)} labels for {len(args.files)} files "
                "(give one per file, or none)")
    for f in args.files:
        if not os.path.isfile(f):
            p.error(f"files: no such file {f}")
    if not args.output.endswith(".png"):
        p.error(f"--output must name a .png file (got {args.output})")
    runs = [read_losses(f) for f in args.files]
    for f, r in zip(args.files, runs):
        if not r:
            p.error(f"files: {f} has no line with 'iteration' and 'lm_loss'")
    labels = args.labels or [os.path.basename(f) for f in args.files]

    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    many = len(runs) > 4  # e.g. loss_match.py's nine arms: taller, small legends in two columns
    fig, (ax, ax_d) = plt.subplots(2, 1, figsize=(8, 8 if many else 6), sharex=True,
                                   gridspec_kw={"height_ratios": [2, 1]})
    ref = runs[0]
    # each run's colour and line style in both panels: ten colours, then dashed, then dotted
    style = [dict(color=f"C{k % 10}", ls=("-", "--", ":")[k // 10 % 3]) for k in range(len(runs))]
    for k, (run, label) in enumerate(zip(runs, labels)):
        its = sorted(run)
        ax.plot(its, [run[i] for i in its], label=label, lw=1.2, **style[k])
    for k, (run, label) in enumerate(zip(runs[1:], labels[1:]), start=1):
        its = sorted(set(run) & set(ref))
        ax_d.plot(its, [run[i] - ref[i] for i in its], label=f"{label} − {labels[0]}", lw=1.0,
                  **style[k])
    ax_d.axhline(0.0, color="grey", lw=0.6)
    ax.set_ylabel("training loss")
    ax_d.set_ylabel("difference")
    ax_d.set_xlabel("iteration")
    ax.legend(fontsize=7 if many else None, ncol=2 if many else 1)
    if len(runs) > 1:
        ax_d.legend(fontsize=6 if many else 8, ncol=2 if many else 1)
    if args.title:
        ax.set_title(args.title)
    fig.tight_layout()
    tmp = args.output[:-4] + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, args.output)
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
