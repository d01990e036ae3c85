"""Quick start: build a GPT with megatron_subq and train it for a few steps, on CPU or one GPU.

    python examples/quickstart.py                      # standard attention, 40 steps
    python examples/quickstart.py --attention-variant asa --steps 60

It uses the library API directly (``SubqTransformerConfig`` -> ``build_gpt_model``) with
megatron-core's DDP wrapper and optimizer, on real text from ../shared/data (byte-level tokens,
so no tokenizer is needed) or random tokens when that file is absent. The full trainer with
Megatron-LM's flags is ``examples/pretrain_gpt.py``.
"""

from __future__ import annotations

import argparse
import lzma
import os
import sys

import torch


def text_batches(seq: int, batch: int, steps: int, seed: int = 0):
    """Byte-level batches of real text (vocab 256). Without the corpus (e.g. on a machine where
    ../shared is absent): a fixed set of 4 random sequences repeated, which a model can memorise."""
    here = os.path.dirname(os.path.abspath(__file__))
    corpus = os.path.join(here, "..", "..", "shared", "data", "docs-corpus.jsonl.xz")
    g = torch.Generator().manual_seed(seed)
    need = (seq + 1) * batch * steps
    if os.path.exists(corpus):
        import json

        data = bytearray()
        with lzma.open(corpus, "rt", encoding="utf-8") as f:
            for line in f:
                data += json.loads(line)["text"].encode("utf-8", "replace")
                if len(data) >= need:
                    break
        ids = torch.tensor(list(data[:need]), dtype=torch.long)
        print(f"data: {corpus} (byte-level)")
    else:
        pool = torch.randint(0, 256, (4 * batch, seq + 1), generator=g)
        ids = pool.repeat(steps // 4 + 1, 1)[: steps * batch].reshape(-1)
        print("data: corpus not found; memorising 4 fixed batches of random bytes")
    ids = ids.view(steps, batch, seq + 1)
    for step in range(steps):
        yield ids[step, :, :-1], ids[step, :, 1:]


def main(argv=None) -> int:
    from megatron_subq import VARIANTS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--attention-variant", default="standard", choices=sorted(VARIANTS))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args(argv)

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_subq import SubqTransformerConfig, build_gpt_model
    from megatron_subq.distributed import free_port
    from megatron_subq.testing import init_parallel

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    torch.distributed.init_process_group(backend, rank=0, world_size=1)
    init_parallel(tp=1, pp=1, seed=1234)

    config = SubqTransformerConfig(
        num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=384, attention_variant=args.attention_variant,
        use_cpu_initialization=True)
    model = build_gpt_model(config, vocab_size=256, max_sequence_length=args.seq_length)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model = model.to(device)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=0.01, clip_grad=1.0), [model])

    n_params = sum(p.numel() for p in model.parameters())
    print(f"variant={args.attention_variant} params={n_params:,} device={device}")
    first = last = None
    for step, (tokens, labels) in enumerate(
            text_batches(args.seq_length, args.micro_batch_size, args.steps), start=1):
        tokens, labels = tokens.to(device), labels.to(device)
        pos = torch.arange(args.seq_length, device=device).expand_as(tokens)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(tokens, pos, None, labels=labels).float().mean()
        loss.backward()
        model.finish_grad_sync()
        ok, grad_norm, _ = optimizer.step()
        first = loss.item() if first is None else first
        last = loss.item()
        if step % 10 == 0 or step == 1:
            print(f"step {step:4d} | lm loss {last:.4f} | grad norm {grad_norm:.3f}")
    torch.distributed.destroy_process_group()
    print(f"loss {first:.3f} -> {last:.3f}")
    return 0 if last < first else 1


if __name__ == "__main__":
    sys.exit(main())
