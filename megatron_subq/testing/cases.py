"""One table of tiny per-variant test settings, read by every test that runs each variant.

``VARIANT_TEST_SETTINGS[name]`` holds the ``SubqTransformerConfig`` keyword arguments a variant
needs on the tests' tiny models (hidden 64, 4 heads, sequences of 16 to 32 tokens); the
equivalence (TP/SP/PP), packed-sequence, checkpoint and trainer tests all take them from here
(the trainer through ``trainer_flags``). ``VARIANT_TEST_TOLERANCES[name]`` loosens the TP
gradient comparison where a variant's own math amplifies fp32 summation-order differences.
A registered variant without an entry fails ``tests/test_variant_unit.py``.
"""

from __future__ import annotations

import os
from typing import Dict, List

FIXED_QK_TOKENS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "tests", "data", "fixed_qk_tokens.txt")
"""64 token ids < 128: fixed_seq_qk's fixed text for sequences up to 64 tokens."""

VARIANT_TEST_SETTINGS: Dict[str, dict] = {
    "standard": {},
    "asa": {"asa_rank": 8, "asa_normalize": "linear"},
    # w=2 so that 16 tokens reach the power offsets 4 and 9 outside the window
    "ppa": {"ppa_power": 0.5, "ppa_window": 2},
    "sas": {"sas_heads": 8, "sas_head_dim": 24},
    "mlp": {},
    "approx": {},
    "nonapprox": {},
    "rnd_emb_qk": {"fixed_qk_seed": 7},
    # hybrid: the fixed row also crosses standard layers and is dropped after its last consumer
    "fixed_seq_qk": {"fixed_qk_tokens_file": FIXED_QK_TOKENS, "layer_pattern": "hybrid"},
    "static_emb_qk": {},
    # w=3: at 16 tokens queries see up to 3 anchors (offsets 3, 8, 15) for top-2, spans reach back
    "superlinear": {"superlinear_sw_index": 1, "superlinear_forward_factor": 0.5},
}

# approx: o1 divides by q~_i . sum_j k~_j, which has no sign; at random init some of these
# denominators are ~1e-3 of |q~| |sum k~| and amplify the ~1e-7 differences of TP's GEMMs ~500x.
# Its tight TP=2(+SP) check runs in float64 in tests/test_deconstructed_linear.py.
VARIANT_TEST_TOLERANCES: Dict[str, dict] = {"approx": {"rtol": 1e-2, "atol": 1e-3}}


def variant_test_settings(name: str) -> dict:
    """The config kwargs of variant ``name`` (``attention_variant`` included)."""
    if name not in VARIANT_TEST_SETTINGS:
        raise KeyError(f"variant {name!r} has no entry in megatron_subq/testing/cases.py's "
                       "VARIANT_TEST_SETTINGS; add one (docs/architecture.md, adding a variant)")
    return {"attention_variant": name, **VARIANT_TEST_SETTINGS[name]}


def trainer_flags(name: str) -> List[str]:
    """The same settings as the trainer's command-line flags (``--attention-variant`` first)."""
    from ..training.fields import flag_for_field  # noqa: PLC0415 (tests only)

    flags = []
    for field_name, value in variant_test_settings(name).items():
        flags += [flag_for_field(field_name), str(value)]
    return flags


__all__ = ["FIXED_QK_TOKENS", "VARIANT_TEST_SETTINGS", "VARIANT_TEST_TOLERANCES",
           "trainer_flags", "variant_test_settings"]
