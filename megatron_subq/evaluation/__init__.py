"""Evaluation of megatron_subq checkpoints (docs/evaluation.md): ``niah.py`` (RULER-style needle
in a haystack), ``lm_eval_model.py`` (the lm-evaluation-harness model ``megatron_subq``)."""
