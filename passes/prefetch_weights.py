"""Ask L2 for the start of the next GEMV's weight while attention runs: the opt-in pass
``prefetch_next_weight``.

At one token each layer's attention and its split-KV reduction take a few microseconds in
which the memory is nearly idle. The o_proj GEMV after them starts early (decode attention
and the reduction signal their dependents at their start, ``kernels/pdl.py``), and its
programs wait for the reduction with their first weight tile loaded. The pass rewrites that
GEMV, a one-row ``gemv`` whose input comes from outside its graph piece (in a model split at
its attention ops, as graphattn's compiler splits it, that is o_proj; without the split, no
GEMV's input is a graph input and the pass rewrites nothing), into ``gemv_prefetch``: the
same product, whose programs also ask L2, before their PDL wait, for the first
``prefetch_bytes()`` of the weight of the next GEMV in the piece (gate_up), so that one
reads that part from L2 instead of HBM. Prefetches return no data, and weights are
parameters no kernel writes.

Opt-in, because it measured no gain: on an H200 (docs/performance-history.md, round 13) the
Llama-3.2-1B-shaped decode step at one token took 0.823 ms without it, 0.823 / 0.818 ms with
8 / 16 MiB (within the spread) and 0.854 ms with 32. Round 17's probe
(``benchmarks/l2_prefetch.py``) found why: on the H200 such prefetches ahead of a streaming
read of a 64 MiB weight changed it by at most 0.26 us at 8-32 MiB, and even plain loads of
those lines saved only a fifth of what reading them from L2 for free would.
``GRAPHATTN_PREFETCH_MIB`` (default 16) sets the amount. Each program asks for at most ``MAX_PREFETCH_LINES`` lines
(``kernels/gemv.py``), so a GEMV of few programs asks for less: o_proj of the Llama-3.2-1B
shape (512 programs) asks for up to 64 MiB.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import fx

from graphattn.envs import prefetch_mib
from graphattn.passes.pass_manager import GraphPass
from graphattn.passes.single_row_gemv import GEMV_OP, module_uuid

aten = torch.ops.aten
# Ops that only re-view their input: o_proj reads the attention output through them.
VIEW_OPS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


@torch.library.custom_op("graphattn::gemv_prefetch", mutates_args=())
def gemv_prefetch(
    x: torch.Tensor, weight: torch.Tensor, next_weight: torch.Tensor, prefetch_bytes: int
) -> torch.Tensor:
    """``x @ weight.T`` by the Triton GEMV, asking L2 for ``next_weight``'s first bytes."""
    from graphattn.kernels.gemv import gemv as launch

    return launch(x, weight, prefetch=next_weight, prefetch_bytes=prefetch_bytes)


@gemv_prefetch.register_fake
def _gemv_prefetch_fake(x, weight, next_weight, prefetch_bytes):
    return x.new_empty((x.shape[0], weight.shape[0]))


GEMV_PREFETCH_OP = torch.ops.graphattn.gemv_prefetch.default


def prefetch_bytes() -> int:
    """How much of the next weight to ask for (``GRAPHATTN_PREFETCH_MIB``, MiB)."""
    return prefetch_mib() << 20


class PrefetchNextWeightPass(GraphPass):
    """Rewrites a one-row ``gemv`` of a piece input into ``gemv_prefetch`` of the next
    GEMV's weight."""

    name: ClassVar[str] = "prefetch_next_weight"

    def uuid(self) -> str:
        return module_uuid(f"{self.name} {prefetch_bytes()}", __name__)

    def __call__(self, graph: fx.Graph) -> int:
        budget = prefetch_bytes()
        if budget == 0:
            return 0
        nodes = list(graph.nodes)
        changed = 0
        for i, node in enumerate(nodes):
            if node.target is not GEMV_OP or not _from_outside(node.args[0]):
                continue
            following = next((w for w in map(_weight_of, nodes[i + 1 :]) if w is not None), None)
            if following is None:
                continue
            if following.meta["val"].device != node.args[0].meta["val"].device:
                continue  # the GEMV asks for lines of its own device only
            value = following.meta["val"]
            nbytes = min(budget, value.numel() * value.element_size())
            with graph.inserting_before(node):
                call = graph.call_function(GEMV_PREFETCH_OP, (*node.args, following, nbytes))
            call.meta["val"] = node.meta["val"]
            node.replace_all_uses_with(call)
            graph.erase_node(node)
            changed += 1
        return changed


def _from_outside(x: fx.Node) -> bool:
    """Whether ``x`` is a placeholder of the graph, or views of one."""
    while isinstance(x, fx.Node) and x.op == "call_function" and x.target in VIEW_OPS:
        x = x.args[0]
    return isinstance(x, fx.Node) and x.op == "placeholder"


def _weight_of(node: fx.Node) -> fx.Node | None:
    """The parameter a graphattn GEMV op streams (its ``weight`` argument), else None."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    if target.namespace != "graphattn":
        return None
    names = [a.name for a in target._schema.arguments]
    if "weight" not in names:
        return None
    index = names.index("weight")
    weight = node.args[index] if index < len(node.args) else node.kwargs.get("weight")
    if not isinstance(weight, fx.Node) or weight.op not in ("placeholder", "get_attr"):
        return None
    value = weight.meta.get("val")
    if not isinstance(value, torch.Tensor) or not value.is_contiguous():
        return None
    return weight
