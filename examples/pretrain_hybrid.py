"""Pretrain (or fine-tune) a hybrid Mamba-2 + attention + MoE model (Nemotron-H layout) whose
attention slots are megatron_subq variants: Megatron-LM's ``pretrain_mamba.py`` counterpart.

    python examples/pretrain_hybrid.py --config recipes/tiny-hybrid-cpu.yaml
    torchrun --nproc-per-node 8 examples/pretrain_hybrid.py \
        --config recipes/nemotron-3-nano-30b-a3b.yaml --attention-variant superlinear ...

The same trainer as examples/pretrain_gpt.py (which also builds a hybrid when given
``--hybrid-override-pattern``); this entry point adds ``--is-hybrid-model``, so a missing
pattern is an error rather than a GPT. See docs/hybrid.md.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
    # imported here: torch_dist saves spawn helper processes that re-import this file
    from megatron_subq.training import pretrain

    argv = list(sys.argv[1:] if argv is None else argv)
    pretrain(["--is-hybrid-model"] + argv)
    return 0


if __name__ == "__main__":  # torch_dist saves spawn writer processes: keep the guard
    sys.exit(main())
