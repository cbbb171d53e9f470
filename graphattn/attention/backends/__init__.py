"""The built-in attention backends; importing this package registers them."""

from graphattn.attention.backends import mla, torch_ref, triton_attn  # noqa: F401
