"""Perplexity of a trained checkpoint on a jsonl file (held-out evaluation).

    python tools/evaluate.py --load runs/asa --input heldout.jsonl.xz
    torchrun --nproc-per-node 2 tools/evaluate.py --load runs/asa --input heldout.jsonl \
        --tensor-model-parallel-size 2

The model shape, variant knobs and tokenizer come from the arguments stored in the checkpoint;
any trainer flag given here overrides them (e.g. a different TP/PP size: the checkpoint is
resharded on load). Documents (``--json-key``, default ``text``) are tokenized, each followed by
EOD, concatenated into one stream and cut into non-overlapping windows of ``--seq-length``
predictions; the last window is padded and its padding masked. Every token of the stream except
the first is predicted exactly once. Prints and returns the token-weighted mean loss and its
perplexity (one JSON line at the end, on the last rank).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def tokenize_stream(path: str, json_key: str, tokenizer, max_documents: Optional[int]) -> List[int]:
    from tools.preprocess_data import open_text  # noqa: PLC0415

    ids: List[int] = []
    with open_text(path) as f:
        for number, line in enumerate(f, start=1):
            if max_documents is not None and number > max_documents:
                break
            if not line.strip():
                continue
            try:
                text = json.loads(line)[json_key]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"--input {path} line {number}: no string {json_key!r} "
                                 f"({type(e).__name__})") from e
            ids.extend(tokenizer.tokenize(text))
            ids.append(tokenizer.eod)
    return ids


def windows(ids: List[int], seq_length: int, eod: int):
    """Samples of seq_length inputs/labels covering every prediction of the stream once."""
    import torch  # noqa: PLC0415

    stream = torch.tensor(ids, dtype=torch.long)
    out = []
    for start in range(0, max(len(ids) - 1, 0), seq_length):
        chunk = stream[start:start + seq_length + 1]
        n = chunk.numel() - 1
        tokens = torch.full((seq_length,), eod, dtype=torch.long)
        labels = torch.full((seq_length,), eod, dtype=torch.long)
        mask = torch.zeros(seq_length)
        tokens[:n], labels[:n], mask[:n] = chunk[:-1], chunk[1:], 1.0
        out.append({"tokens": tokens, "labels": labels, "loss_mask": mask,
                    "position_ids": torch.arange(seq_length)})
    return out


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--load", required=True, help="checkpoint folder (with the tracker file)")
    p.add_argument("--input", required=True, help=".jsonl / .jsonl.gz / .jsonl.xz")
    p.add_argument("--json-key", default="text")
    p.add_argument("--ckpt-step", type=int, default=None)
    p.add_argument("--max-documents", type=int, default=None)
    p.add_argument("--output", default=None, help="also write the result as JSON here")
    own, trainer_flags = p.parse_known_args(argv)
    if not os.path.isfile(own.input):
        p.error(f"--input {own.input}: no such file")

    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from megatron_subq.training import arguments  # noqa: PLC0415
    from megatron_subq.training.checkpointing import (  # noqa: PLC0415
        load_checkpoint,
        prepare_load,
        saved_args,
    )
    from megatron_subq.training.tokenizer import build_tokenizer  # noqa: PLC0415
    from megatron_subq.training.trainer import (  # noqa: PLC0415
        _device,
        _reduce_losses,
        build_config,
        build_model,
        initialize_distributed,
        schedule_kwargs,
        teardown,
    )

    try:
        saved = saved_args(own.load, own.ckpt_step)
    except Exception as e:  # noqa: BLE001
        p.error(f"--load {own.load}: no readable checkpoint ({type(e).__name__}: {e})")
    parser = arguments.build_parser()
    dests = {a.dest for a in parser._actions if a.option_strings}
    keep = {k: v for k, v in saved.items() if k in dests}
    for k in ("data_path", "train_data_path", "valid_data_path", "test_data_path",
              "data_args_path", "per_split_data_args_path", "save",
              "save_interval", "load", "ckpt_step", "global_batch_size", "metrics_file",
              "tensorboard_dir", "wandb_project", "train_iters", "train_samples", "skip_train",
              "mock_data", "config", "distributed_backend",
              # a deliberate model change is this run's decision, not the checkpoint's
              "allow_model_change", "use_checkpoint_args",
              # the layout is this run's (default 1 x 1; the checkpoint reshards)
              "tensor_model_parallel_size", "pipeline_model_parallel_size", "sequence_parallel",
              "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
              "use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather"):
        keep.pop(k, None)
    base = arguments.config_to_argv(parser, keep, "the checkpoint's arguments")
    world = dist.get_world_size() if dist.is_initialized() else None
    args = arguments.parse_args(base + ["--mock-data", "--skip-train", "--load", own.load,
                                        "--no-load-optim", "--no-load-rng", "--num-workers", "0"]
                                + (["--ckpt-step", str(own.ckpt_step)]
                                   if own.ckpt_step is not None else []) + trainer_flags,
                                world_size=world)
    created = initialize_distributed(args)
    try:
        from megatron.core import parallel_state  # noqa: PLC0415
        from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: PLC0415

        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
        log = lambda *m: dist.get_rank() == 0 and print(*m)  # noqa: E731
        try:  # the checkpoint's padded vocabulary; flags given here must not change the model
            vocab = prepare_load(args, tokenizer.vocab_size, log=log)
        except ValueError as e:
            arguments.fail(args, str(e))
        config = build_config(args)
        model = build_model(args, config, vocab)
        iteration, _, _ = load_checkpoint(args, model, None, None, log=log)
        ids = tokenize_stream(own.input, own.json_key, tokenizer, own.max_documents)
        samples = windows(ids, args.seq_length, tokenizer.eod)
        args.eod_token = tokenizer.eod  # document ends under --reset-attention-mask
        dp_rank = parallel_state.get_data_parallel_rank()
        dp_size = parallel_state.get_data_parallel_world_size()
        mbs = args.micro_batch_size
        mine = samples[dp_rank::dp_size]
        steps = math.ceil(len(samples) / dp_size / mbs)  # equal on every DP rank
        for chunk in model:
            chunk.eval()
        total = torch.zeros(2, dtype=torch.float32, device=_device())
        with torch.no_grad():
            for step in range(steps):
                part = mine[step * mbs:(step + 1) * mbs]
                while len(part) < mbs:  # pad with fully masked samples
                    empty = dict(samples[0])
                    empty["loss_mask"] = torch.zeros(args.seq_length)
                    part.append(empty)
                batch = {k: torch.stack([s[k] for s in part]) for k in part[0]}
                # a model trained with --reset-attention-mask is evaluated the same way
                losses = get_forward_backward_func()(
                    data_iterator=iter([batch]), model=model, num_microbatches=1,
                    **schedule_kwargs(args),
                    forward_only=True)
                reduced = _reduce_losses(losses)
                if reduced is not None:
                    total += reduced
        result = None
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            loss = (total[0] / total[1].clamp(min=1)).item()
            result = {"checkpoint": own.load, "iteration": iteration, "input": own.input,
                      "tokens": int(total[1].item()), "loss": loss,
                      "perplexity": math.exp(loss)}
        if dist.get_rank() == dist.get_world_size() - 1:
            print(f"perplexity {result['perplexity']:.4f} (loss {result['loss']:.6f}) over "
                  f"{result['tokens']:,} tokens of {own.input} at iteration {iteration}")
            print(json.dumps(result), flush=True)
            if own.output:
                with open(own.output, "w", encoding="utf-8") as f:
                    json.dump(result, f)
        return result
    finally:
        teardown(created)


if __name__ == "__main__":
    main()
