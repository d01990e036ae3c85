"""Quick start: build a GPT with megatron_subq and train it for a few steps, on CPU or one GPU.

    python examples/quickstart.py                      # standard attention, 40 steps
    python examples/quickstart.py --attention-variant asa --steps 60
    python examples/quickstart.py --hybrid --attention-variant superlinear   # Mamba-2 + MoE host

It uses the library API directly (``init_single_process`` -> ``SubqTransformerConfig`` ->
``build_gpt_model``; with ``--hybrid``, ``hybrid_preset("tiny-hybrid")`` -> ``build_hybrid_model``:
Mamba-2, attention, MLP and MoE layers) with megatron-core's DDP wrapper, ``finalize_model_grads``
(which also updates a MoE router's expert bias), optimizer and LR scheduler (warm-up, then
cosine decay), on real text from ../shared/data (byte-level tokens, so no tokenizer is needed) or
random tokens when that file is absent. Every 10 steps it prints the loss on a fixed held-out set,
which must end below its value at step 10 (the exit status is 1 otherwise); single batches' losses
are too noisy to show that. The full trainer with Megatron-LM's flags is
``examples/pretrain_gpt.py``.
"""

from __future__ import annotations

import argparse
import lzma
import os
import sys

import torch


def text_batches(seq: int, batch: int, steps: int, heldout: int, seed: int = 0):
    """(training batches, held-out batches) of byte-level real text (vocab 256), as [n, b, seq+1]
    token tensors; the held-out bytes follow the training bytes in the corpus. Without the corpus
    (e.g. on a machine where ../shared is absent): 4 fixed random batches, for training and held
    out alike, which a model can memorise."""
    here = os.path.dirname(os.path.abspath(__file__))
    corpus = os.path.join(here, "..", "..", "shared", "data", "docs-corpus.jsonl.xz")
    g = torch.Generator().manual_seed(seed)
    need = (seq + 1) * batch * (steps + heldout)
    if os.path.exists(corpus):
        import json

        data = bytearray()
        with lzma.open(corpus, "rt", encoding="utf-8") as f:
            for line in f:
                data += json.loads(line)["text"].encode("utf-8", "replace")
                if len(data) >= need:
                    break
        ids = torch.tensor(list(data[:need]), dtype=torch.long).view(-1, batch, seq + 1)
        print(f"data: {corpus} (byte-level)")
        return ids[:steps], ids[steps:]
    pool = torch.randint(0, 256, (4, batch, seq + 1), generator=g)
    print("data: corpus not found; memorising 4 fixed batches of random bytes")
    return pool.repeat(steps // 4 + 1, 1, 1)[:steps], pool


def main(argv=None) -> int:
    from megatron_subq import VARIANTS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--attention-variant", default="standard", choices=sorted(VARIANTS))
    p.add_argument("--hybrid", action="store_true",
                   help="the tiny hybrid Mamba-2 + MoE host (docs/hybrid.md) instead of a GPT")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args(argv)

    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_subq import (
        SubqTransformerConfig,
        build_gpt_model,
        destroy_single_process,
        init_single_process,
    )

    init_single_process(seed=1234)
    if args.hybrid:
        from megatron_subq.hybrid import build_hybrid_model, hybrid_preset

        config, kwargs = hybrid_preset("tiny-hybrid", attention_variant=args.attention_variant,
                                       use_cpu_initialization=True, vocab_size=256,
                                       max_sequence_length=args.seq_length)
        model = build_hybrid_model(config, **kwargs)
    else:
        config = SubqTransformerConfig(
            num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2,
            ffn_hidden_size=384, attention_variant=args.attention_variant,
            use_cpu_initialization=True)
        model = build_gpt_model(config, vocab_size=256, max_sequence_length=args.seq_length)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model = model.to(device)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.lr / 10, weight_decay=0.01,
                        clip_grad=1.0), [model])
    warmup = max(1, args.steps // 10)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.lr / 10, lr_warmup_steps=warmup,
        lr_decay_steps=args.steps, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
        wd_incr_steps=args.steps, wd_incr_style="constant")

    train, heldout = text_batches(args.seq_length, args.micro_batch_size, args.steps, heldout=4)
    pos = torch.arange(args.seq_length, device=device).expand(args.micro_batch_size, -1)

    def heldout_loss() -> float:
        model.eval()
        with torch.no_grad():
            losses = [model(b[:, :-1].to(device), pos, None, labels=b[:, 1:].to(device))
                      .float().mean().item() for b in heldout]
        model.train()
        return sum(losses) / len(losses)

    n_params = sum(p.numel() for p in model.parameters())
    print(f"variant={args.attention_variant} params={n_params:,} device={device}")
    evals = {0: heldout_loss()}
    print(f"step    0 | held-out loss {evals[0]:.4f}")
    for step, batch in enumerate(train, start=1):
        tokens, labels = batch[:, :-1].to(device), batch[:, 1:].to(device)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(tokens, pos, None, labels=labels).float().mean()
        loss.backward()
        finalize_model_grads([model])  # DP gradient sync, SP norms, MoE expert-bias update
        ok, grad_norm, _ = optimizer.step()
        if ok:
            scheduler.step(increment=1)
        if step % 10 == 0 or step == args.steps:
            evals[step] = heldout_loss()
            print(f"step {step:4d} | lm loss {loss.item():.4f} | held-out loss "
                  f"{evals[step]:.4f} | grad norm {grad_norm:.3f} | "
                  f"lr {optimizer.param_groups[0]['lr']:.2e}")
    destroy_single_process()
    early_step = 10 if args.steps > 10 else 0
    first, early, last = evals[0], evals[early_step], evals[args.steps]
    print(f"held-out loss {first:.3f} at step 0 -> {early:.3f} at step {early_step} -> "
          f"{last:.3f} at step {args.steps}")
    return 0 if last < early else 1


if __name__ == "__main__":
    sys.exit(main())
