"""Example models built on ``ga.Attention``."""

from graphattn.models.llama import LlamaConfig, LlamaForCausalLM, init_random_weights

__all__ = ["LlamaConfig", "LlamaForCausalLM", "init_random_weights"]
