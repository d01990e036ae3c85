"""Evaluation of megatron_subq checkpoints: the lm-evaluation-harness model (``lm_eval_model``,
needs the ``eval`` extra) and its command line (``python -m megatron_subq.evaluation.lm_eval``)."""
