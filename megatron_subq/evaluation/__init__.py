"""Evaluation of megatron_subq checkpoints (docs/evaluation.md)."""
