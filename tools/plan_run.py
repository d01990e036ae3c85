#!/usr/bin/env python
"""Plan a training run: parameters, parallel layout, memory per GPU, tokens, time to train.

    python tools/plan_run.py --config recipes/asa-1.3b-100b.yaml --nodes 4 [--gpus-per-node 8]
        [--gpu H100|H200|A100-80GB] [--tp N] [--pp N] [--cp N] [--ep N] [--micro-batch-size N]
        [--throughput-file recipes/throughput.yaml] [--scaling-efficiency E] [--json]
        [any trainer flag, e.g. --recompute-granularity full]

Nothing is started or allocated: the recipe goes through the trainer's own argument checks
(without the data files), the counts are arithmetic (megatron_subq/training/plan.py, the formulas
in docs/training.md). Exit status 0 when the plan is sound, 2 with every problem (each naming its
flag) when the layout or memory is not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_subq.training.plan import (  # noqa: E402
    DEFAULT_SCALING_EFFICIENCY,
    GPUS,
    THROUGHPUT_FILE,
    PlanError,
    format_plan,
    plan_run,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="plan_run.py", description=__doc__.split("\n\n")[0], allow_abbrev=False,
        epilog="Other flags are passed to the trainer's parser (they override the recipe).")
    p.add_argument("--config", required=True, help="the recipe (trainer YAML/JSON)")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu", default="H100", choices=sorted(GPUS))
    p.add_argument("--tp", type=int, default=None, help="--tensor-model-parallel-size override")
    p.add_argument("--pp", type=int, default=None,
                   help="--pipeline-model-parallel-size override")
    p.add_argument("--cp", type=int, default=1,
                   help="--context-parallel-size override (the sequence split over N GPUs)")
    p.add_argument("--ep", type=int, default=None, help="--expert-model-parallel-size override")
    p.add_argument("--micro-batch-size", type=int, default=None)
    p.add_argument("--throughput-file", default=THROUGHPUT_FILE)
    p.add_argument("--scaling-efficiency", type=float, default=None,
                   help="fraction of the measured per-GPU throughput kept at this size (default "
                        f"1.0 up to the measured GPU count, {DEFAULT_SCALING_EFFICIENCY} beyond)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def main(argv=None) -> int:
    opts, extra = build_parser().parse_known_args(argv)
    try:
        plan = plan_run(opts.config, opts.nodes, opts.gpus_per_node, opts.gpu, tp=opts.tp,
                        pp=opts.pp, cp=opts.cp, ep=opts.ep,
                        micro_batch_size=opts.micro_batch_size, extra=extra,
                        throughput_file=opts.throughput_file,
                        scaling_efficiency=opts.scaling_efficiency)
    except PlanError as e:
        if opts.json:
            print(json.dumps({"config": opts.config, "problems": e.problems}, indent=1))
        else:
            for problem in e.problems:
                print(f"error: {problem}", file=sys.stderr)
        return 2
    if opts.json:
        print(json.dumps(plan.to_dict(), indent=1, default=str))
    else:
        print(format_plan(plan))
    return 2 if plan.problems else 0


if __name__ == "__main__":
    sys.exit(main())
