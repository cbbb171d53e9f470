"""Attention kernels over the paged KV cache: Triton kernels and their plain-torch references.

This package imports only torch and triton.
"""
