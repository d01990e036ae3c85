"""Evaluation suites on megatron_subq checkpoints (``niah.py``: RULER-style needle in a
haystack)."""
