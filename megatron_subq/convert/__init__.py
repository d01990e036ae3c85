"""Checkpoint conversion between Hugging Face folders and the trainer's torch_dist checkpoints.

    from megatron_subq.convert import import_hf, export_hf
    import_hf("Llama-3.2-1B", "ckpt/llama", attention_variant="asa", layer_pattern="hybrid")
    export_hf("ckpt/llama-finetuned", "hf/llama-finetuned")

``tools/convert_checkpoint.py`` is the command line over the same functions. Families (HF
architectures) live in ``families/``, one module each; see docs/conversion.md. Needs the
``[convert]`` extra (transformers, safetensors).
"""

from .api import ConversionSummary, export_hf, import_hf, load_converted_model, model_flags
from .families import FAMILIES, Family, TensorMap, supported_architectures

__all__ = ["FAMILIES", "ConversionSummary", "Family", "TensorMap", "export_hf", "import_hf",
           "load_converted_model", "model_flags", "supported_architectures"]
