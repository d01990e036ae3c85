"""The trainer behind ``examples/pretrain_gpt.py``: Megatron-LM's flags on megatron-core's building
blocks (see docs/training.md).

    from megatron_subq.training import pretrain
    pretrain(["--num-layers", "2", "--hidden-size", "64", ...])   # or torchrun pretrain_gpt.py

Modules: ``arguments`` (flags, ``--config`` files, start-up checks), ``fields`` (the variant
knobs as flags), ``blend`` (the ``--data-path`` blend syntax), ``tokenizer``, ``data``
(GPTDataset + resumable sampler), ``checkpointing`` (torch_dist, tracker written last),
``flops`` (per-variant model FLOPs), ``metrics`` (log line, TensorBoard, W&B), ``processes``
(workers and checkpoint writers die with their parent, the ``--save`` lock), ``trainer``.
"""

from .arguments import build_parser, parse_args
from .trainer import pretrain

__all__ = ["build_parser", "parse_args", "pretrain"]
