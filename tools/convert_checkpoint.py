#!/usr/bin/env python
"""Convert checkpoints between Hugging Face folders and the trainer's torch_dist checkpoints.

    python tools/convert_checkpoint.py import --hf DIR --save DIR [--tensor-model-parallel-size N]
        [--pipeline-model-parallel-size N] [--expert-model-parallel-size N]
        [--attention-variant V] [--layer-pattern P] [variant knobs...]
    python tools/convert_checkpoint.py export --load DIR --hf-out DIR [--ckpt-step N]
        [--hf-config FILE] [--max-shard-size 5GB]

The variant knobs are the trainer's (``--asa-rank``, ``--superlinear-sw-index``, ...). Errors
exit with status 2 and a message naming the flag, field or file. See docs/conversion.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def build_parser() -> argparse.ArgumentParser:
    from megatron_subq.convert.families import supported_architectures
    from megatron_subq.training.arguments import add_variant_arguments

    p = argparse.ArgumentParser(
        prog="convert_checkpoint.py", allow_abbrev=False,
        description="Hugging Face <-> megatron_subq torch_dist checkpoints "
                    f"(architectures: {', '.join(supported_architectures())}).")
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", allow_abbrev=False,
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                         help="HF folder -> torch_dist checkpoint (+ model.yaml)")
    imp.add_argument("--hf", required=True, help="Hugging Face folder (config.json + safetensors)")
    imp.add_argument("--save", required=True, help="new or empty checkpoint folder")
    imp.add_argument("--tensor-model-parallel-size", type=int, default=1,
                     help="checked against heads/groups/widths/vocabulary; written into "
                          "model.yaml (the checkpoint loads at any)")
    imp.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                     help="checked against the layer count; written into model.yaml")
    imp.add_argument("--expert-model-parallel-size", type=int, default=1,
                     help="1 for models without experts; NemotronH MoE: a divisor of "
                          "n_routed_experts (written into model.yaml)")
    imp.add_argument("--seed", type=int, default=1234,
                     help="seeds the initialisation of the variant's new parameters, as the "
                          "trainer's --seed")
    imp.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_variant_arguments(imp)

    exp = sub.add_parser("export", allow_abbrev=False,
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                         help="torch_dist checkpoint -> HF folder")
    exp.add_argument("--load", required=True, help="checkpoint folder (holds the tracker file)")
    exp.add_argument("--hf-out", required=True, help="new or empty Hugging Face folder")
    exp.add_argument("--ckpt-step", type=int, default=None,
                     help="the iteration to export; None: the tracker's")
    exp.add_argument("--hf-config", default=None,
                     help="config.json (or its folder) whose architecture and extra fields to "
                          "keep; None: the one an import stored in --load, else inferred")
    exp.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard")
    exp.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _knobs(args) -> dict:
    """The variant knobs given on the command line (those that differ from their defaults)."""
    from megatron_subq.training.fields import variant_fields

    out = {}
    for f in variant_fields():
        if f.name in ("attention_variant", "layer_pattern") or not hasattr(args, f.name):
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        if getattr(args, f.name) != default:
            out[f.name] = getattr(args, f.name)
    return out


def main(argv: Optional[List[str]] = None):
    parser = build_parser()
    args = parser.parse_args(argv)
    from megatron_subq.convert import export_hf, import_hf

    try:
        if args.command == "import":
            return import_hf(
                args.hf, args.save,
                tensor_model_parallel_size=args.tensor_model_parallel_size,
                pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                expert_model_parallel_size=args.expert_model_parallel_size,
                attention_variant=args.attention_variant, layer_pattern=args.layer_pattern,
                knobs=_knobs(args), seed=args.seed, progress=not args.no_progress)
        return export_hf(args.load, args.hf_out, ckpt_step=args.ckpt_step,
                         hf_config=args.hf_config, max_shard_size=args.max_shard_size,
                         progress=not args.no_progress)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        parser.error(f"{args.command}: {e}")


if __name__ == "__main__":
    main()
