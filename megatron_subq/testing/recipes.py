"""Recipe checks for tests/test_recipes.py: models built on the meta device (nothing allocated)."""

from __future__ import annotations

from typing import List, Sequence


def meta_parameter_counts(argvs: Sequence[Sequence[str]], cpu: Sequence[bool] = ()) -> List[int]:
    """Parameters of the model each trainer command line builds (TP=PP=1, meta device; on the
    CPU where ``cpu[i]``: a tiny model whose construction reads tensor values), counted
    as ``sum(p.numel() for p in model.parameters())`` (shared tensors once). Runs inside a
    one-rank world (``testing.distributed.run_distributed``): megatron's modules need its
    parallel state."""
    import torch  # noqa: PLC0415

    from ..training.arguments import parse_args  # noqa: PLC0415
    from ..training.tokenizer import padded_vocab_size  # noqa: PLC0415
    from ..training.trainer import bare_model, build_config  # noqa: PLC0415

    out = []
    for i, argv in enumerate(argvs):
        args = parse_args(list(argv), world_size=1, check_files=False)
        config = build_config(args)
        config.perform_initialization = False
        vocab = padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by,
                                  args.tensor_model_parallel_size)
        on_cpu = i < len(cpu) and cpu[i]
        with torch.device("cpu" if on_cpu else "meta"):
            model = bare_model(args, config, vocab)
        assert on_cpu or all(p.is_meta for p in model.parameters())
        out.append(sum(p.numel() for p in model.parameters()))
    return out
