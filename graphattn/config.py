"""CompileConfig: every start-up setting of an engine, frozen and validated once."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from graphattn import envs
from graphattn.capture.mode import CUDAGraphMode
from graphattn.errors import ConfigError

_DTYPES = {
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float": torch.float32,
}
COMPILE_BACKENDS = ("inductor", "eager", "none")
# max_model_len=None: this, or less where the model declares fewer positions
DEFAULT_MAX_MODEL_LEN = 8192


def parse_dtype(value: torch.dtype | str | None, what: str) -> torch.dtype | None:
    """A torch float dtype from a dtype or its name; None stays None."""
    if value is None or isinstance(value, torch.dtype):
        if value is not None and value not in _DTYPES.values():
            raise ConfigError(f"{what} must be float16, bfloat16 or float32, got {value}")
        return value
    if isinstance(value, str) and value.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.lower().removeprefix("torch.")]
    raise ConfigError(f"{what} must be one of {sorted(_DTYPES)} or a torch dtype, got {value!r}")


# The post-grad passes on by default (graphattn.passes.pass_manager knows them all). The GEMV
# passes touch only one-token builds (compile_sizes). silu_mul_gemv is opt-in: on an H200 it
# measured on par with the kernels it replaces (passes/prologue_gemv.py).
DEFAULT_PASSES = (
    "noop_elimination",
    "unfuse_residual_addmm",
    "rms_norm_gemv",
    "silu_mul_epilogue",
    "rope_epilogue",
    "single_row_gemv",
)


@dataclass(frozen=True)
class CompileConfig:
    """How ``ga.compile`` builds an engine. Every field is checked in ``__post_init__``.

    Sizes:
        max_num_seqs: most requests in one step.
        max_num_tokens: most tokens (summed over requests) in one step.
        max_model_len: most tokens in one request (computed plus new); None takes 8192, or
            the model's ``config.max_position_embeddings`` where that is smaller. The engine
            refuses a value above what the model declares (its rotary table ends there).
        block_size: tokens per KV-cache block as the caller's block ids count them.
        num_blocks: blocks in the KV cache of every layer.
    Numerics:
        dtype: activation dtype; None takes the model's parameter dtype.
        kv_cache_dtype: "auto" (the activation dtype) or a float dtype name.
    Attention:
        attention_backend: a registered backend name for every layer, or None to select.
    Compilation and graphs:
        cudagraph_mode: NONE, PIECEWISE, FULL, FULL_DECODE_ONLY or FULL_AND_PIECEWISE.
        cudagraph_capture_sizes: batch sizes (tokens) to capture; None takes the default list.
        uniform_decode_query_len: the query tokens of every request in the batches that
            full decode graphs serve: 1, or for speculative decoding 1 + the draft tokens a
            verify step scores per request. Batches whose requests all have this many run the
            decode mode's graphs (FULL under FULL_AND_PIECEWISE); the default capture sizes
            become multiples of it. A backend below UNIFORM_BATCH support lowers a FULL
            decode mode when it is above 1.
        compile_backend: "inductor", "eager" (trace and split, no Inductor) or "none" (no trace;
            passes, splitting_ops and compile_sizes set with it are still checked, and logged
            as unused).
        compile_sizes: token counts that also get a specialised Inductor build; None takes
            (1,) on CUDA with the inductor backend, a GEMV pass (single_row_gemv,
            rms_norm_gemv or silu_mul_gemv: the one-token build runs its linear layers as
            Triton GEMVs), a bf16 or fp16 model and CUDA graphs that cover one token, ()
            otherwise.
        splitting_ops: op names to split the traced graph at; None takes the attention ops.
        passes: post-grad passes Inductor runs on every piece (by name).
        cache_dir: compile cache folder; None takes ``$GRAPHATTN_CACHE_DIR`` or the user cache.
        trace_cache: save the Dynamo trace with the compiled pieces, so a warm start skips
            Dynamo (the key covers the model's source, attributes and tensors; turn it off
            for a model whose code reads globals that change at run time).
        debug_dump_path: folder for decompiled code, graphs and Inductor output.
    Behaviour:
        strict: raise instead of lowering the mode (per-step fallbacks and the start-up
            warning for decode batches without a full graph are not lowerings).
        debug: extra checks (input addresses at replay, recompiles raise, a warm start
            traces anyway and compares with the trace cache's graph, the first step
            wrote each backend's KV cache, no block is used at two entries of a step's
            block tables and, once blocks were taken with engine.kv_cache.allocate, every
            block a step uses is allocated and at the entry of its last use).
    """

    max_num_seqs: int = 128
    max_num_tokens: int = 4096
    max_model_len: int | None = None
    block_size: int = 16
    num_blocks: int = 1024
    dtype: torch.dtype | str | None = None
    kv_cache_dtype: str = "auto"
    attention_backend: str | None = None
    cudagraph_mode: CUDAGraphMode | str = CUDAGraphMode.FULL_AND_PIECEWISE
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    uniform_decode_query_len: int = 1
    compile_backend: str = "inductor"
    compile_sizes: tuple[int, ...] | None = None
    splitting_ops: tuple[str, ...] | None = None
    passes: tuple[str, ...] = DEFAULT_PASSES
    cache_dir: str | None = None
    trace_cache: bool = True
    debug_dump_path: str | None = None
    strict: bool = False
    debug: bool = field(default_factory=envs.debug)

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_tokens",
            "max_model_len",
            "block_size",
            "num_blocks",
            "uniform_decode_query_len",
        ):
            value = getattr(self, name)
            if value is None and name == "max_model_len":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        q = self.uniform_decode_query_len
        if q > self.max_num_tokens or (self.max_model_len is not None and q > self.max_model_len):
            raise ConfigError(
                f"uniform_decode_query_len={q} exceeds max_num_tokens={self.max_num_tokens}"
                + (f" or max_model_len={self.max_model_len}" if self.max_model_len else "")
                + ": not one request of a uniform decode batch would fit a step"
            )
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        self._set("dtype", parse_dtype(self.dtype, "dtype"))
        if self.kv_cache_dtype is None:
            raise ConfigError('kv_cache_dtype must be "auto" or a float dtype, got None')
        if isinstance(self.kv_cache_dtype, str) and self.kv_cache_dtype.lower() == "auto":
            self._set("kv_cache_dtype", "auto")
        else:
            try:
                parse_dtype(self.kv_cache_dtype, "kv_cache_dtype")
            except ConfigError as e:
                raise ConfigError(f'{e} (or "auto": the activation dtype)') from None
        if self.attention_backend is not None and not isinstance(self.attention_backend, str):
            raise ConfigError(
                f"attention_backend must be a backend name or None, got {self.attention_backend!r}"
            )
        try:
            self._set("cudagraph_mode", CUDAGraphMode.parse(self.cudagraph_mode))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ConfigError(
                f"compile_backend must be one of {COMPILE_BACKENDS}, got {self.compile_backend!r}"
            )
        if self.compile_sizes is not None:
            self._set("compile_sizes", _positive_sizes(self.compile_sizes, "compile_sizes"))
        if self.cudagraph_capture_sizes is not None:
            sizes = _positive_sizes(self.cudagraph_capture_sizes, "cudagraph_capture_sizes")
            self._set("cudagraph_capture_sizes", sizes)
            usable = [n for n in sizes if n <= self.max_num_tokens]
            if not usable and self.cudagraph_mode != CUDAGraphMode.NONE:
                raise ConfigError(
                    f"cudagraph_mode {self.cudagraph_mode} needs a capture size <= "
                    f"max_num_tokens={self.max_num_tokens}, got cudagraph_capture_sizes="
                    f"{list(sizes)} (cudagraph_mode='NONE' runs without graphs)"
                )
            if (
                self.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
                and not self.has_decode_capture_size()
            ):
                bound = min(self.max_num_seqs * q, self.max_num_tokens)
                per = "" if q == 1 else f" that is a multiple of uniform_decode_query_len={q}"
                raise ConfigError(
                    f"cudagraph_mode FULL_DECODE_ONLY captures graphs for decode batches only, "
                    f"of at most max_num_seqs={self.max_num_seqs} requests, and needs a capture "
                    f"size <= {bound}{per}; got cudagraph_capture_sizes={list(sizes)}"
                )
        if self.splitting_ops is not None:
            if isinstance(self.splitting_ops, str) or not all(
                isinstance(op, str) for op in self.splitting_ops
            ):
                raise ConfigError(
                    f"splitting_ops must be a list of op names, got {self.splitting_ops!r}"
                )
            self._set("splitting_ops", tuple(self.splitting_ops))
        for name in ("trace_cache", "strict", "debug"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("cache_dir", "debug_dump_path"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ConfigError(f"{name} must be a folder path or None, got {value!r}")
            if value is not None:
                self._set(name, os.fspath(value))
        if isinstance(self.passes, str) or not all(isinstance(p, str) for p in self.passes):
            raise ConfigError(f"passes must be a list of pass names, got {self.passes!r}")
        self._set("passes", tuple(self.passes))

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def has_decode_capture_size(self) -> bool:
        """True when a uniform decode batch can pad to a capture size with a full decode
        graph: a multiple of ``uniform_decode_query_len`` of at most ``max_num_seqs``
        requests (and within the token limit). The default sizes always end at that bound.
        """
        sizes, q = self.cudagraph_capture_sizes, self.uniform_decode_query_len
        bound = min(self.max_num_seqs * q, self.max_num_tokens)
        return sizes is None or any(n <= bound and n % q == 0 for n in sizes)

    @property
    def max_blocks_per_seq(self) -> int:
        """Width of a request's block table: enough blocks for ``max_model_len`` tokens
        (an engine's config, whose ``max_model_len`` the engine has resolved)."""
        if self.max_model_len is None:
            raise ConfigError("max_model_len=None is resolved by the engine (engine.config)")
        return -(-self.max_model_len // self.block_size)

    def resolved_max_model_len(self, model_positions: int | None) -> tuple[int, str]:
        """``max_model_len`` for a model that declares ``model_positions`` positions (None:
        declares none), and where the value came from; a value above the model's is a
        ``ConfigError``."""
        if self.max_model_len is not None:
            if model_positions is not None and self.max_model_len > model_positions:
                raise ConfigError(
                    f"max_model_len={self.max_model_len} exceeds the model's "
                    f"max_position_embeddings={model_positions}: positions past it have no "
                    "rotary embedding"
                )
            return self.max_model_len, "set"
        if model_positions is not None and model_positions < DEFAULT_MAX_MODEL_LEN:
            return model_positions, "the model's max_position_embeddings"
        return DEFAULT_MAX_MODEL_LEN, "the default"

    def resolved_compile_sizes(
        self,
        device: torch.device,
        graphed_sizes: Sequence[int] = (),
        dtype: torch.dtype = torch.bfloat16,
    ) -> tuple[int, ...]:
        """``compile_sizes``, or when it is None the default: ``(1,)`` for a CUDA engine whose
        graphs cover one token (``graphed_sizes``: the capture sizes, empty without graphs),
        in bf16 or fp16 (the dtypes the GEMV passes rewrite), with the inductor backend and
        a GEMV pass; else ``()``. The one-token build calls the GEMV as a Python op per
        linear layer: cheap inside a graph, a host cost per layer in a step without one.
        """
        if self.compile_sizes is not None:
            return self.compile_sizes
        gemv_passes = {"single_row_gemv", "rms_norm_gemv", "silu_mul_gemv"} & set(self.passes)
        gemv = self.compile_backend == "inductor" and bool(gemv_passes)
        half = dtype in (torch.bfloat16, torch.float16)
        return (1,) if gemv and half and device.type == "cuda" and 1 in graphed_sizes else ()

    def replace(self, **changes: Any) -> CompileConfig:
        """A copy with ``changes`` applied and validated again."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_kwargs(cls, config: CompileConfig | None, **overrides: Any) -> CompileConfig:
        """``config`` (or the defaults) with keyword overrides; an unknown key is an error."""
        if config is not None and not isinstance(config, CompileConfig):
            raise ConfigError(
                f"config must be a CompileConfig (or pass its fields as keywords), got "
                f"{type(config).__name__}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"unknown CompileConfig field(s) {unknown}; known: {sorted(known)}")
        base = config if config is not None else cls()
        return dataclasses.replace(base, **overrides) if overrides else base


def _positive_sizes(sizes: Any, name: str) -> tuple[int, ...]:
    try:
        values = tuple(sizes)
    except TypeError:
        raise ConfigError(f"{name} must be a list of positive ints, got {sizes!r}") from None
    bad = [s for s in values if not isinstance(s, int) or isinstance(s, bool) or s < 1]
    if bad:
        raise ConfigError(f"{name} must hold positive ints, got {bad}")
    return values
