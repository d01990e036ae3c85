"""Pretrain a GPT whose attention is a megatron_subq variant, with Megatron-LM's flags.

    torchrun --nproc-per-node 2 examples/pretrain_gpt.py \
        --attention-variant asa --num-layers 12 --hidden-size 768 --num-attention-heads 12 \
        --seq-length 2048 --micro-batch-size 4 --global-batch-size 64 --train-iters 1000 \
        --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 100 --bf16 \
        --tensor-model-parallel-size 2 --sequence-parallel \
        --data-path data/docs_text_document --split 98,2,0 \
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model mistral \
        --save runs/asa --save-interval 200 --eval-interval 200 --eval-iters 10

    python examples/pretrain_gpt.py --config recipes/tiny-cpu.yaml      # a recipe; flags override

``--help`` lists every flag (Megatron-LM's, then the variant knobs). docs/training.md explains the
data tools, checkpoints, logs and FLOP counts. Without CUDA it runs on the CPU (gloo).
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))



def main(argv=None) -> int:
    # imported here, not at the top: torch_dist checkpointing starts a helper process with the
    # "spawn" method, which re-imports this file; keeping it light keeps saves fast
    from megatron_subq.training import pretrain

    pretrain(argv)
    return 0


if __name__ == "__main__":  # torch_dist saves spawn writer processes: keep the guard
    sys.exit(main())
