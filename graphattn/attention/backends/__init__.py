"""The built-in attention backends; importing this package registers them."""

from graphattn.attention.backends import torch_ref, triton_attn  # noqa: F401
