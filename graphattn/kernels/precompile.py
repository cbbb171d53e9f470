"""Compile graphattn's Triton kernels before their first launch, several at once.

Triton compiles a kernel at the first launch of each specialisation (its constexprs, the
alignment of its pointers, ints equal to 1 or divisible by 16), in the launching thread.
graphattn's kernels first launch in the compile phase's runs (the one-token GEMVs) and a
capture's warm-ups (attention, its reduction, staging...), one after another, so a cold start
waits for every compile in turn: about 7.5 s of a capture on a slow host of the H200 machine
(round 21's cProfile: LLVM, ptxas, the code generator and, per signature, a launcher built
with gcc; docs/performance-history.md). A warm Triton cache skips them. Both phases run once dry
inside ``compile_ahead`` first (``passes/compiler.py``'s ``_dry_run``, the runner's
``capture_graphs``).

``compile_ahead(device, threads)`` is a context in which a launch of one of graphattn's
kernels does not run: it goes down Triton's warm-up path, which under Triton's
``AsyncCompileMode`` hands the compile to a thread pool and returns. Each job then also loads
the compiled module and builds its launcher (what the first launch would do). Leaving the
context waits for all of them. The caller runs its warm-ups once inside (their outputs are
garbage: graphattn's kernels wrote nothing) and again after, for real, when every launch finds
its kernel compiled. That extra pass is not free (one eager run of every key), so the engine
skips it where Triton's cache most likely holds the kernels already: after a warm compile.
Ops that index memory with values computed from the garbage would read out of bounds; a
model with such ops should turn the pool off (``GRAPHATTN_PRECOMPILE_THREADS=0``).

Compiling releases the GIL for most of its time (the MLIR and LLVM passes, ptxas and gcc
run outside Python), so threads suffice: six attention kernels for sm_90 compiled in 8.7 s
one after another and 4.2 s on two threads of the development machine's two cores.

Only launches of kernels defined in graphattn's modules are held back; Inductor's kernels
launch through their own launchers and run as usual. A compile that fails in the pool is
dropped and happens again, with its error, at the real launch.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

OURS = "graphattn."  # module prefix of the kernels compile_ahead holds back
# why a start skips the pool after its pieces came from the caches (compile phase and capture)
WARM_SKIP = "a warm compile (pieces from the cache): Triton's cache most likely has the kernels"


@dataclass
class PrecompileReport:
    """What ``compile_ahead`` did, for the engine's report."""

    status: str  # "on", or "off: why" / "skipped: why" / "unavailable: why" (nothing held back)
    threads: int = 0
    launches: int = 0  # launches of graphattn's kernels turned into compiles
    compiled: int = 0  # distinct specialisations sent to the pool
    seconds: float = 0.0  # inside the context, the wait for the pool included
    errors: list[str] = field(default_factory=list)  # compiles the pool dropped

    @property
    def active(self) -> bool:
        return self.status == "on"

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": self.status}
        if self.active:
            out |= {
                "threads": self.threads,
                "launches": self.launches,
                "compiled": self.compiled,
                "seconds": round(self.seconds, 2),
            }
            if self.errors:
                out["errors"] = self.errors
        return out


def unavailable_reason(device: torch.device) -> str | None:
    """Why ``compile_ahead`` cannot work on ``device``, or None when it can."""
    if device.type != "cuda":
        return f"kernels compile only for CUDA devices, got {device.type}"
    try:
        from triton.runtime._async_compile import AsyncCompileMode  # noqa: F401
        from triton.runtime.jit import JITFunction  # noqa: F401
    except ImportError as e:
        return f"this Triton has no AsyncCompileMode ({e})"
    return None


@contextlib.contextmanager
def compile_ahead(
    device: torch.device, threads: int, skip: str | None = None
) -> Iterator[PrecompileReport]:
    """Inside, graphattn's Triton launches compile on ``threads`` threads instead of running;
    on leaving, every compile has finished (see the module). ``threads`` < 2, a ``skip``
    reason, a device other than CUDA or a Triton without ``AsyncCompileMode``: launches run
    as usual, and the report says why (``status``)."""
    if threads < 2:
        yield PrecompileReport("off: GRAPHATTN_PRECOMPILE_THREADS < 2")
        return
    if skip is not None:
        yield PrecompileReport(f"skipped: {skip}")
        return
    reason = unavailable_reason(device)
    if reason is not None:
        yield PrecompileReport(f"unavailable: {reason}")
        return
    from triton.runtime._async_compile import AsyncCompileMode
    from triton.runtime.jit import JITFunction

    report = PrecompileReport("on", threads=threads)
    index = device.index if device.index is not None else torch.cuda.current_device()
    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if not warmup and _defined_in_graphattn(self):
            report.launches += 1
            warmup = True  # compile (on the pool) and return; nothing is launched
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    start = time.perf_counter()
    pool = _CompileAndLoad(threads, index, report)
    try:
        mode = AsyncCompileMode(pool, ignore_errors=True)
    except TypeError:  # a Triton before ignore_errors: a failed compile raises on leaving
        mode = AsyncCompileMode(pool)
    try:
        JITFunction.run = run
        with mode:
            try:
                yield report
            finally:
                JITFunction.run = original  # before the wait: nothing more is held back
                report.compiled = len(getattr(mode, "future_kernels", ()))
    finally:
        JITFunction.run = original
        pool.shutdown(wait=True)
        report.seconds = time.perf_counter() - start


def pin_ptxas(device: torch.device) -> str:
    """Settle which ptxas compiles Triton kernels in this process before graphattn's first
    compile, the way Inductor settles it; returns the report's line.

    Triton keys its on-disk cache on the ptxas it would call: ``TRITON_PTXAS_PATH`` if set,
    else its own. Inductor points that variable at torch's bundled ptxas the first time it
    compiles or loads a kernel in the main process (``_set_triton_ptxas_path``, where torch
    ships one). A cold start reaches that point after graphattn's kernels compiled, a start
    from the caches before any of them: it missed Triton's cache for every kernel the cold
    start wrote and compiled them again, one after another in its capture (15 kernels, 2-4 s
    on the H200 machine, round 26). Making Inductor's choice first, in every process, keys
    every start alike. A ``TRITON_PTXAS_PATH`` the user set is kept (Inductor keeps it too).
    """
    if device.type != "cuda":
        return f"not pinned: kernels compile only for CUDA devices, got {device.type}"
    try:
        from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path
    except ImportError:
        return f"not pinned: torch {torch.__version__} has no _set_triton_ptxas_path"
    _set_triton_ptxas_path()
    path = os.environ.get("TRITON_PTXAS_PATH")
    return f"TRITON_PTXAS_PATH={path}" if path else "Triton's own (torch ships none)"


def _defined_in_graphattn(kernel: Any) -> bool:
    fn = getattr(kernel, "fn", None)
    return getattr(fn, "__module__", "").startswith(OURS)


class _CompileAndLoad(ThreadPoolExecutor):
    """A thread pool whose jobs, once the compile returns a kernel, also load its module and
    build its launcher on ``device_index`` (Triton does both when a kernel's ``run`` is
    first read), so the first real launch finds them done."""

    def __init__(self, threads: int, device_index: int, report: PrecompileReport) -> None:
        super().__init__(max_workers=threads, thread_name_prefix="graphattn-compile")
        self._device_index = device_index
        self._report = report

    def submit(self, fn, /, *args, **kwargs) -> Future:
        def compile_and_load():
            try:
                kernel = fn(*args, **kwargs)
            except Exception as e:  # the real launch compiles again and raises it there
                self._report.errors.append(f"{type(e).__name__}: {e}"[:200])
                raise
            # the first launch loads it instead if this fails
            with torch.cuda.device(self._device_index), contextlib.suppress(Exception):
                kernel.run  # noqa: B018 (reading it loads the module, builds the launcher)
            return kernel

        return super().submit(compile_and_load)
