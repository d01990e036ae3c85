"""Hugging Face remote code for NemotronH with Superlinear attention (``trust_remote_code``).

The two files beside this one are copied verbatim into an exported folder (``export_hf``), with
config.json's ``auto_map`` pointing at them; they import transformers and torch only (megatron_subq
lazily, on CUDA, when installed). This package exists so that a pip install carries them and the
project's tests can import them directly.
"""

import os

FOLDER = os.path.dirname(os.path.abspath(__file__))
MODEL_TYPE = "nemotron_h_superlinear"
ARCHITECTURE = "NemotronHSuperlinearForCausalLM"
FILES = ("configuration_nemotron_h_superlinear.py", "modeling_nemotron_h_superlinear.py")
AUTO_MAP = {
    "AutoConfig": "configuration_nemotron_h_superlinear.NemotronHSuperlinearConfig",
    "AutoModelForCausalLM": "modeling_nemotron_h_superlinear.NemotronHSuperlinearForCausalLM",
}
