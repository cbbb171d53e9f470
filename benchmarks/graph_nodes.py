"""What a full graph holds, node by node (CUDA).

A profile shows kernels and the time between them, not the graph: whether a gap holds a
node the profiler does not list (an event, a memset, a memcpy), and which dependencies are
programmatic (a PDL launch) rather than full. This script builds the decode benchmark's
engine (``--mode``, default FULL), keeps the topology of each graph it captures
(``torch.cuda.CUDAGraph(keep_graph=True)`` while ``ga.compile`` runs), and reads the full
graphs of the chosen batch sizes through the CUDA driver API: every node's type, each
kernel's name and launch shape, and each edge's type (default, programmatic, launch
completion), with the nodes in dependency order.

    python benchmarks/graph_nodes.py --batches 1,32 --out $OUT/graph_nodes.json --dot $OUT
    python benchmarks/graph_nodes.py --import my_backends --attention-backend MY_BACKEND

docs/performance-history.md (round 18) has what it found in the batch-1 FULL graph.
"""

from __future__ import annotations

import argparse
import ctypes
import heapq
import importlib
import json
import sys
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

# CUgraphNodeType and CUgraphDependencyType (cuda.h)
NODE_TYPES = {
    0: "kernel",
    1: "memcpy",
    2: "memset",
    3: "host",
    4: "child graph",
    5: "empty",
    6: "event wait",
    7: "event record",
    8: "semaphore signal",
    9: "semaphore wait",
    10: "mem alloc",
    11: "mem free",
    12: "batch mem op",
    13: "conditional",
}
EDGE_TYPES = {0: "default", 1: "programmatic", 2: "launch completion"}
DOT_VERBOSE = 1  # CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE


class _KernelParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2: only the function and the launch shape are read."""

    _fields_ = [
        ("func", ctypes.c_void_p),
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem_bytes", ctypes.c_uint),
        ("kernel_params", ctypes.c_void_p),
        ("extra", ctypes.c_void_p),
        ("kern", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
    ]


class DriverError(RuntimeError):
    pass


class Driver:
    """The few graph queries of the CUDA driver API this script needs (``libcuda``)."""

    def __init__(self, lib: str = "libcuda.so.1") -> None:
        self.cu = ctypes.CDLL(lib)

    def _call(self, name: str, *args) -> None:
        rc = getattr(self.cu, name)(*args)
        if rc != 0:
            raise DriverError(f"{name} returned CUresult {rc}")

    def nodes(self, graph: int) -> list[int]:
        count = ctypes.c_size_t(0)
        self._call("cuGraphGetNodes", ctypes.c_void_p(graph), None, ctypes.byref(count))
        nodes = (ctypes.c_void_p * count.value)()
        self._call("cuGraphGetNodes", ctypes.c_void_p(graph), nodes, ctypes.byref(count))
        return [n or 0 for n in nodes]

    def edges(self, graph: int) -> list[tuple[int, int, int]]:
        """(from, to, edge type). The v2 query: a graph with programmatic edges refuses the
        plain one (CUDA_ERROR_LOSSY_QUERY), which cannot say an edge's type."""
        count = ctypes.c_size_t(0)
        g = ctypes.c_void_p(graph)
        self._call("cuGraphGetEdges_v2", g, None, None, None, ctypes.byref(count))
        n = count.value
        src, dst = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)()
        data = (ctypes.c_ubyte * (8 * n))()  # CUgraphEdgeData: from_port, to_port, type, 5 reserved
        self._call("cuGraphGetEdges_v2", g, src, dst, data, ctypes.byref(count))
        return [(src[i] or 0, dst[i] or 0, data[8 * i + 2]) for i in range(n)]

    def node(self, node: int) -> dict:
        kind = ctypes.c_int(0)
        self._call("cuGraphNodeGetType", ctypes.c_void_p(node), ctypes.byref(kind))
        out = {"type": NODE_TYPES.get(kind.value, f"type {kind.value}")}
        if kind.value == 0:
            params = _KernelParams()
            self._call("cuGraphKernelNodeGetParams_v2", ctypes.c_void_p(node), ctypes.byref(params))
            name = ctypes.c_char_p()
            self._call("cuFuncGetName", ctypes.byref(name), ctypes.c_void_p(params.func))
            out |= {
                "name": (name.value or b"?").decode(errors="replace"),
                "grid": list(params.grid),
                "block": list(params.block),
            }
        return out

    def dot(self, graph: int, path: Path) -> None:
        self._call("cuGraphDebugDotPrint", ctypes.c_void_p(graph), str(path).encode(), DOT_VERBOSE)


def dependency_order(nodes: Sequence[int], edges: Sequence[tuple[int, int, int]]) -> list[int]:
    """The nodes with every node after all the nodes it depends on (Kahn's order, ties in
    the order ``nodes`` lists them)."""
    position = {n: i for i, n in enumerate(nodes)}
    waiting = Counter(dst for _, dst, _ in edges)
    after = defaultdict(list)
    for src, dst, _ in edges:
        after[src].append(dst)
    ready = [(position[n], n) for n in nodes if not waiting[n]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for m in after[n]:
            waiting[m] -= 1
            if not waiting[m]:
                heapq.heappush(ready, (position[m], m))
    if len(order) != len(nodes):
        raise ValueError(f"the edges hold a cycle: {len(nodes) - len(order)} nodes never ready")
    return order


def describe(nodes: dict[int, dict], edges: Sequence[tuple[int, int, int]]) -> dict:
    """Counts by node and edge type, and the nodes in dependency order, each with the types
    of the edges into it and the positions they come from."""
    order = dependency_order(list(nodes), edges)
    position = {n: i for i, n in enumerate(order)}
    into = defaultdict(list)
    for src, dst, kind in edges:
        into[dst].append({"from": position[src], "edge": EDGE_TYPES.get(kind, f"type {kind}")})
    return {
        "nodes": len(nodes),
        "by_type": dict(Counter(info["type"] for info in nodes.values())),
        "edges": dict(Counter(EDGE_TYPES.get(k, f"type {k}") for _, _, k in edges)),
        "order": [nodes[n] | {"after": sorted(into[n], key=lambda e: e["from"])} for n in order],
    }


@contextmanager
def graphs_kept() -> Iterator[None]:
    """Graphs created inside keep their topology after instantiation (``keep_graph=True``),
    so ``raw_cuda_graph()`` can be queried later."""
    original = torch.cuda.CUDAGraph

    def keeping(*args, **kwargs):
        return original(*args, **{**kwargs, "keep_graph": True})

    torch.cuda.CUDAGraph = keeping
    try:
        yield
    finally:
        torch.cuda.CUDAGraph = original


def read_graph(driver: Driver, graph: int) -> dict:
    nodes = {n: driver.node(n) for n in driver.nodes(graph)}
    return describe(nodes, driver.edges(graph))


def format_graph(label: str, d: dict, head: int, tail: int) -> list[str]:
    lines = [f"{label}: {d['nodes']} nodes {d['by_type']}, edges {d['edges']}"]
    order = d["order"]
    shown = list(enumerate(order))
    if len(order) > head + tail:
        shown = shown[:head] + [(None, None)] + shown[-tail:]
    for i, node in shown:
        if i is None:
            lines.append("     ...")
            continue
        what = node["type"]
        if "name" in node:
            what = f"{node['name'][:48]} grid {tuple(node['grid'])} block {node['block'][0]}"
        came = ", ".join(f"{e['edge']} from {e['from']}" for e in node["after"]) or "root"
        lines.append(f"  {i:4d} {what}  <- {came}")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mode", default="FULL", help="the engine (a graphattn mode with full graphs)")
    p.add_argument("--batches", default="1", help="decode sizes whose full graphs are read")
    p.add_argument("--attention-backend", help="the engine's backend (default: the benchmark's)")
    p.add_argument(
        "--import",
        dest="modules",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first (one that registers a backend); repeatable",
    )
    p.add_argument("--head", type=int, default=12, help="nodes printed from the start")
    p.add_argument("--tail", type=int, default=4, help="and from the end")
    p.add_argument("--dot", help="folder for each graph's cuGraphDebugDotPrint file")
    p.add_argument("--out", help="JSON path")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    for module in a.modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            print(f"--import {module}: {e}", file=sys.stderr)
            return 2
    if not torch.cuda.is_available():
        print("graph_nodes.py reads CUDA graphs: no CUDA device here", file=sys.stderr)
        return 2
    import graphattn as ga
    from benchmarks import decode as D

    batches = [int(b) for b in a.batches.split(",")]
    args = ["--parts", "latency", "--baselines", "", "--batch-sizes", a.batches, "--modes", a.mode]
    if a.attention_backend:
        args += ["--attention-backend", a.attention_backend]
    s = D.settings_from_args(D.parse_args(args))
    model = D.build_model(s)
    with graphs_kept():
        engine = ga.compile(model, **s.engine_kwargs(D.ENGINE_SPECS[a.mode]))
    wrapper = engine.runner.forward
    entries = getattr(wrapper, "entries", None)
    if not entries:
        print(f"{a.mode} captured no full graphs ({engine.report.resolved_mode})", file=sys.stderr)
        return 1
    driver, out = Driver(), {"mode": a.mode, "graphs": {}}
    for key, entry in sorted(entries.items(), key=lambda kv: str(kv[0])):
        if key.num_tokens not in batches:
            continue
        label = f"tokens {key.num_tokens}, requests {key.num_reqs}" + (
            ", uniform decode" if key.uniform_decode else ", mixed"
        )
        handle = entry.graph.raw_cuda_graph()
        d = out["graphs"][label] = read_graph(driver, handle)
        print("\n".join(format_graph(label, d, a.head, a.tail)))
        if a.dot:
            name = f"graph-{key.num_tokens}-{'decode' if key.uniform_decode else 'mixed'}.dot"
            driver.dot(handle, Path(a.dot) / name)
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
