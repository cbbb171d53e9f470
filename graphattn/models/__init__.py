"""Example models built on ``ga.Attention``, and ``load`` for Hugging Face checkpoints."""

from graphattn.models.hf import ModelLoadError, UnsupportedModelError, WeightMismatchError, load
from graphattn.models.llama import LlamaConfig, LlamaForCausalLM, init_random_weights

__all__ = [
    "LlamaConfig",
    "LlamaForCausalLM",
    "ModelLoadError",
    "UnsupportedModelError",
    "WeightMismatchError",
    "init_random_weights",
    "load",
]
