"""Example models built on ``ga.Attention`` (Llama) and ``ga.MLAAttention`` (a DeepSeek-V2-style MLA decoder), and ``load`` for Hugging Face checkpoints."""

from graphattn.models.hf import ModelLoadError, UnsupportedModelError, WeightMismatchError, load
from graphattn.models.llama import LlamaConfig, LlamaForCausalLM, init_random_weights
from graphattn.models.mla import MLAConfig, MLAForCausalLM

__all__ = [
    "LlamaConfig",
    "LlamaForCausalLM",
    "MLAConfig",
    "MLAForCausalLM",
    "ModelLoadError",
    "UnsupportedModelError",
    "WeightMismatchError",
    "init_random_weights",
    "load",
]
