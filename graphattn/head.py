"""A linear layer outside the compiled graph (a model's head): the one-row Triton GEMV where
it beats cuBLAS, ``F.linear`` everywhere else.

A decode step at batch 1 ends with ``compute_logits`` on one row: for a 128k-vocabulary head
that is one 0.5 GB weight read, 24% of a 1B model's step. cuBLAS reads it in 122.5 us on
an H200 (and runs a memset before it); ``graphattn.kernels.gemv`` in 117.6 us
(``docs/results/gemv-h200.log``). Inside the compiled graph the ``single_row_gemv`` pass
makes the same choice; the head runs eagerly, after the graph, so it calls this instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Where the GEMV may run (tests add "cpu": the interpreter runs it there).
KERNEL_DEVICES: tuple[str, ...] = ("cuda",)


def linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K], an nn.Linear weight
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; one row without a bias goes through the GEMV (fp32
    accumulation, as cuBLAS's), which only one-row shapes have measured configs for. The
    GEMV has no backward: where autograd would record the call, ``F.linear`` runs."""
    if (
        bias is None
        and x.dim() == 2
        and x.shape[0] == 1
        and x.device.type in KERNEL_DEVICES
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        # imported here so that `import graphattn` does not import Triton
        from graphattn.kernels.gemv import gemv, gemv_supported

        if not torch.compiler.is_compiling() and gemv_supported(x, weight, KERNEL_DEVICES):
            return gemv(x, weight)
    return F.linear(x, weight, bias)
