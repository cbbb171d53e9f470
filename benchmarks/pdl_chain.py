"""What programmatic dependent launch (PDL) would buy the batch-1 decode step: a chain of
one-row GEMVs, each launched normally and with PDL, in CUDA graphs.

    python benchmarks/pdl_chain.py --out $OUT/pdl_chain.json       # a Hopper GPU (~1 minute)
    TRITON_INTERPRET=1 python benchmarks/pdl_chain.py --smoke       # CPU: the plumbing only

At one token the step's linear layers are 64 one-row GEMVs (16 layers of qkv 3072x2048,
o 2048x2048, gate_up 16384x2048, down 2048x8192), each reading its whole weight and
nothing else of size. Between two launches the GPU drains the first kernel's last
programs and ramps the next one's up; PDL lets the next kernel's programs start while the
first drains, load the first tile of their weights (which no earlier kernel writes), and
wait (``griddepcontrol.wait``) only before they read the previous kernel's output.

The chain here is a true dependency chain: GEMV i reads the first K outputs of GEMV i-1
(each output is at least as wide as the next K), with its own weights (1.95 GB in all,
far beyond L2). Variants, each a CUDA graph of the 64 launches replayed after warm-up
(median of CUDA-event timings):
- ``library``: ``graphattn.kernels.gemv`` with its one-row configs, as the step runs it
  (since round 8 with PDL on Hopper: first weight tile, wait, signal after the loop);
- ``library_no_pdl``: the same with ``GRAPHATTN_PDL=0`` (the step up to round 7);
- ``chain``: this file's kernel, the same tiling, launched normally;
- ``chain_pdl``: the same kernel launched with ``launch_pdl=True``: each program loads its
  first weight tile, signals ``griddepcontrol.launch_dependents`` and waits;
- ``chain_pdl_late``: the same, signalling only after its loop (the next kernel's programs
  start while this one's last programs store).
Each variant's output of one more replay, started with every output buffer set to NaN
(so a kernel that read its input early would carry NaN through), is compared with the
normal launch's and with an fp32 reference. The kernel here is a measurement, not part of graphattn.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks import attention as ab  # noqa: E402
from graphattn.kernels.gemv import choose_gemv_config, gemv  # noqa: E402
from graphattn.kernels.pdl import use_pdl  # noqa: E402

LAYER = (("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192))
PDL_VARIANTS = {"chain_pdl": 1, "chain_pdl_late": 2}  # variant: the kernel's PDL value
RACY = {"chain_pdl_nowait": 3}  # the tests' control: PDL without the wait
LIBRARY = {"library": "1", "library_no_pdl": "0"}  # variant: GRAPHATTN_PDL
SMOKE_LAYER = (("qkv", 48, 32), ("o", 32, 32), ("gate_up", 96, 32), ("down", 32, 64))


@triton.jit
def _chain_gemv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    N,
    K,  # a multiple of BLOCK_K
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    # 0: a normal launch; 1: signal dependents early; 2: after the loop; 3: signal early and
    # never wait (a deliberate race, which the GPU test must see)
    PDL: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * K + cols[None, :]
    w = tl.load(w_ptrs)  # weights: no earlier kernel writes them
    if PDL == 1 or PDL == 3:
        tl.extra.cuda.gdc_launch_dependents()
    if PDL == 1 or PDL == 2:
        tl.extra.cuda.gdc_wait()  # the previous kernel's output is complete after this
    x = tl.load(x_ptr + cols)
    acc = w.to(tl.float32) * x.to(tl.float32)[None, :]
    for k in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        w = tl.load(w_ptrs + k)
        x = tl.load(x_ptr + k + cols)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=rows < N)


def chain_gemv(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, pdl: int) -> None:
    """y[N] = w[N, K] @ x[:K] with the library's one-row tiling."""
    n, k = w.shape
    cfg = choose_gemv_config(1, n, k, 1)
    if k % cfg.block_k:
        raise ValueError(f"K={k} must be a multiple of block_k={cfg.block_k}")
    extra = {"launch_pdl": True} if pdl else {}
    _chain_gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x,
        w,
        y,
        n,
        k,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        STAGES=cfg.num_stages,
        PDL=pdl,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **extra,
    )


@contextlib.contextmanager
def pdl_setting(value: str):
    """``GRAPHATTN_PDL=value`` for the launches inside (a graph records them as launched)."""
    before = os.environ.get("GRAPHATTN_PDL")
    os.environ["GRAPHATTN_PDL"] = value
    use_pdl.cache_clear()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("GRAPHATTN_PDL")
        else:
            os.environ["GRAPHATTN_PDL"] = before
        use_pdl.cache_clear()


class Chain:
    """The 64 weights and outputs; ``run(variant)`` launches the chain once."""

    def __init__(self, layers: int, shapes, device: str, seed: int) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        self.weights, self.outs = [], []
        for _ in range(layers):
            for _, n, k in shapes:
                w = torch.randn(n, k, generator=gen, device=device) / k**0.5
                self.weights.append(w.to(torch.bfloat16))
                self.outs.append(torch.empty(n, dtype=torch.bfloat16, device=device))
        first_k = shapes[0][2]
        self.x = torch.randn(first_k, generator=gen, device=device).to(torch.bfloat16)
        self.bytes = sum(w.numel() * w.element_size() for w in self.weights)

    def inputs(self):
        prev = self.x
        for w, y in zip(self.weights, self.outs):
            yield prev[: w.shape[1]], w, y
            prev = y

    def run(self, variant: str) -> torch.Tensor:
        if variant in LIBRARY:
            with pdl_setting(LIBRARY[variant]):
                for x, w, y in self.inputs():
                    gemv(x[None, :], w, y[None, :])
            return self.outs[-1]
        for x, w, y in self.inputs():
            chain_gemv(x, w, y, pdl=PDL_VARIANTS.get(variant, RACY.get(variant, 0)))
        return self.outs[-1]

    def reference(self) -> torch.Tensor:
        """The chain in fp32 with each output rounded to bf16, as the kernels store it."""
        prev = self.x.float()
        for w, _ in zip(self.weights, self.outs):
            prev = (w.float() @ prev[: w.shape[1]]).to(torch.bfloat16).float()
        return prev


def time_graph(chain: Chain, variant: str, reps: int, device: str) -> dict:
    chain.run(variant)  # compile outside the graph
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain.run(variant)
    for _ in range(5):
        graph.replay()
    times = [ab._event_seconds(graph.replay) for _ in range(reps)]
    # The checked replay starts from poisoned outputs: a kernel that read its input before
    # the previous kernel wrote it would carry NaN to the end.
    for y in chain.outs:
        y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize(device)
    out = chain.outs[-1].float().clone()
    return {"seconds": statistics.median(times), "min_s": min(times), "output": out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes; no timings")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", help="JSON path")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    smoke = a.smoke or device == "cpu"
    shapes = SMOKE_LAYER if smoke else LAYER
    chain = Chain(2 if smoke else 16, shapes, device, seed=0)
    expected = chain.reference()
    result: dict = {
        "meta": {
            "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "launches": len(chain.weights),
            "weight_bytes": chain.bytes,
            "smoke": smoke,
            "method": __doc__,
        },
        "variants": {},
    }
    pdl_ok = device == "cuda" and torch.cuda.get_device_capability()[0] >= 9
    variants = ["library", "library_no_pdl", "chain"] + (list(PDL_VARIANTS) if pdl_ok else [])
    outputs = {}
    for variant in variants:
        try:
            if smoke:
                out = chain.run(variant).float().clone()
                entry: dict = {"status": "ok (smoke: not timed)"}
            else:
                timed = time_graph(chain, variant, a.reps, device)
                out = timed.pop("output")
                entry = {"status": "ok", **timed}
                entry["us_per_launch"] = timed["seconds"] / len(chain.weights) * 1e6
                entry["TB_per_s"] = chain.bytes / timed["seconds"] / 1e12
            entry["max_abs_err_vs_fp32"] = float((out - expected).abs().max())
            outputs[variant] = out
        except Exception as e:  # a variant that cannot run is recorded; the others go on
            entry = {"status": f"unavailable: {type(e).__name__}: {e}"[:400]}
            traceback.print_exc()
        result["variants"][variant] = entry
    if "chain" in outputs:
        for variant, out in outputs.items():
            result["variants"][variant]["equal_to_chain"] = bool(torch.equal(out, outputs["chain"]))
    if "library" in outputs and "library_no_pdl" in outputs:  # the library's PDL against none
        same = bool(torch.equal(outputs["library"], outputs["library_no_pdl"]))
        result["variants"]["library"]["equal_to_no_pdl"] = same
    print_table(result)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
    # PDL's output differing from the normal launch's would be a race: a failed run
    races = [
        v for v in PDL_VARIANTS if result["variants"].get(v, {}).get("equal_to_chain") is False
    ]
    if result["variants"].get("library", {}).get("equal_to_no_pdl") is False:
        races.append("library")
    return 1 if races else 0


def print_table(result: dict) -> None:
    meta = result["meta"]
    print(
        f"one-row GEMV chain: {meta['launches']} launches, {meta['weight_bytes'] / 1e9:.3f} GB of "
        f"weights; {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}"
    )
    print(
        f"  {'variant':14s} {'us/chain':>9s} {'us/launch':>10s} {'TB/s':>6s} {'= chain':>8s} "
        f"{'err vs fp32':>12s}  status"
    )
    for name, e in result["variants"].items():
        secs = e.get("seconds")
        print(
            f"  {name:14s} {secs * 1e6 if secs else float('nan'):9.1f} "
            f"{e.get('us_per_launch', float('nan')):10.2f} {e.get('TB_per_s', float('nan')):6.2f} "
            f"{e.get('equal_to_chain', '-')!s:>8s} {e.get('max_abs_err_vs_fp32', float('nan')):12.4g}"
            f"  {e['status']}"
        )


if __name__ == "__main__":
    sys.exit(main())
