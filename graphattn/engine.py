"""``CompiledModel``: the start-up sequence and the per-step entry points of an engine."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from graphattn import envs
from graphattn._logging import logger
from graphattn.attention.backend import AttentionCGSupport
from graphattn.attention.forward_context import BoundLayer, set_forward_context
from graphattn.attention.groups import AttentionGroup, build_attention_groups
from graphattn.attention.layer import Attention
from graphattn.attention.ops import ATTENTION_OP
from graphattn.attention.registry import select_backend
from graphattn.batch import Batch, is_int
from graphattn.capture.manager import CaptureManager
from graphattn.capture.mode import CUDAGraphMode
from graphattn.capture.resolve import FallbackRecord, resolve_for_engine
from graphattn.config import CompileConfig, parse_dtype
from graphattn.errors import (
    BackendError,
    ConfigError,
    CUDAGraphModeError,
    FallbackWarning,
    GraphAttnError,
    InvalidInputError,
    arrived,
)
from graphattn.kernels import attention_plan, pdl, precompile, triton_import_error
from graphattn.kv_cache import (
    FullAttentionSpec,
    KVCache,
    KVCacheGroup,
    MLAAttentionSpec,
    SlidingWindowSpec,
    group_layers_by_spec,
)
from graphattn.model_contract import call_error, output_error
from graphattn.report import EngineStats, GroupInfo, LayerInfo, Report
from graphattn.runner import ModelRunner
from graphattn.validation import BatchLimits

if TYPE_CHECKING:
    from graphattn.passes.compiler import CompiledForward


class CompiledModel:
    """A model made into an engine: backends selected, KV cache allocated, modes resolved.

    ``step(batch)`` runs one forward step; ``generate(prompts, max_new_tokens)`` decodes
    greedily with continuous batching. ``report`` says what start-up decided; ``stats``
    counts what steps did; ``kv_cache`` owns the cache tensors and the block allocator.
    """

    def __init__(self, model: nn.Module, config: CompileConfig) -> None:
        start = time.perf_counter()
        if not isinstance(model, nn.Module):
            what = (
                f"the class {model.__name__}" if isinstance(model, type) else type(model).__name__
            )
            raise InvalidInputError(
                f"expected an nn.Module instance (ga.models.load(path) for a checkpoint), got "
                f"{what}"
            )
        self.model = model
        max_model_len, self.max_model_len_from = config.resolved_max_model_len(
            _declared_positions(model)
        )
        self.config = config = config.replace(max_model_len=max_model_len)
        self.device, self.dtype = _device_and_dtype(model, config)
        self.kernel_settings = _kernel_settings(self.device)  # a bad variable fails here
        # before anything compiles, so every process keys Triton's cache alike
        self.kernel_settings["ptxas"] = precompile.pin_ptxas(self.device)
        self.precompile_threads = envs.precompile_threads()
        self.input_staging, staging_note = _input_staging()
        self.kv_cache_dtype = (
            self.dtype
            if config.kv_cache_dtype == "auto"
            else parse_dtype(config.kv_cache_dtype, "kv_cache_dtype")
        )
        self.layers = find_attention_layers(model)
        self.bound = self._select_backends()
        self.kv_cache, self.attn_groups = self._allocate_kv_cache()
        self.requested_mode = config.cudagraph_mode
        self.resolved_mode, self.fallbacks = self._negotiate_mode()
        self._stats = EngineStats()
        self.runner = ModelRunner(
            self.model,
            self.bound,
            self.kv_cache.groups,
            self.attn_groups,
            self._limits(),
            self.device,
            stats=self._stats,
            uniform_decode_query_len=config.uniform_decode_query_len,
        )
        self.graphs = CaptureManager(
            self.resolved_mode,
            capture_sizes=config.cudagraph_capture_sizes,
            max_num_seqs=config.max_num_seqs,
            max_num_tokens=config.max_num_tokens,
            device=self.device,
            debug=config.debug,
            uniform_decode_query_len=config.uniform_decode_query_len,
        )
        if self.graphs.decode_gap:
            logger.warning("%s", self.graphs.decode_gap)
            warnings.warn(self.graphs.decode_gap, FallbackWarning, stacklevel=3)
        graphed = self.graphs.dispatcher.sizes if self.graphs.mode != CUDAGraphMode.NONE else ()
        self.inductor_pdl, self.kernel_settings["inductor_pdl"] = _inductor_pdl(
            self.device, self.graphs.mode, config.compile_backend
        )
        self.fold_o_proj, self.kernel_settings["o_proj_fold"] = _fold_o_proj(config.compile_backend)
        self.compile_sizes = config.resolved_compile_sizes(self.device, graphed, self.dtype)
        self.compiled = self._compile()
        forward = self.compiled if self.compiled is not None else _one_tensor(self.model)
        self.runner.copies_in_full_graphs = (
            self.graphs.mode.has_full_cudagraphs() and self.runner.can_copy_in_graphs
        )
        self.runner.input_staging = self.input_staging
        self.runner.precompile_threads = self.precompile_threads
        self.runner.precompile_skip = _precompile_skip(self.compiled)
        prologue = self.runner.full_graph_prologue if self.runner.copies_in_full_graphs else None
        self.runner.forward = self.graphs.wrap_model(forward, prologue)
        weights = dict(self.model.named_parameters())
        weights.update(self.model.named_buffers())
        self.capture_info = self.graphs.capture(self.runner, weights)
        if self.capture_info:  # graphs were captured
            self.capture_info["kernel_precompile"] = self.runner.precompile.as_dict()
        else:  # the capture's warm-ups did not build metadata: build it once here
            self.runner.build_once()
        if self.graphs.mode.has_full_cudagraphs():
            self.capture_info["input_copies"] = (
                "inside full graphs" if self.runner.copies_in_full_graphs else "before each step"
            )
            needing = self.runner.builders_needing_replay_build()
            self.capture_info["metadata_on_full_replays"] = (
                f"built each step ({', '.join(needing)}: full_replay_needs_build)"
                if needing
                else "skipped (no builder needs build on a replay)"
            )
            if self.runner.copies_in_full_graphs:
                self.capture_info["input_staging"] = (
                    "one kernel reading the pinned buffers"
                    if self.input_staging == "kernel"
                    else f"three memcpy nodes ({staging_note or 'GRAPHATTN_INPUT_STAGING=copies'})"
                )
        self.runner.planner = self.graphs.dispatcher.dispatch
        # debug: the first step that runs checks that it wrote each backend's KV cache
        self._check_kv_writes = config.debug
        self.report = self._make_report(time.perf_counter() - start)
        logger.info("graphattn engine ready:\n%s", self.report)

    # -- per step ---------------------------------------------------------------------

    @property
    def stats(self) -> EngineStats:
        """What steps did: steps and tokens, runtime modes, per-step fallbacks, recompiles."""
        if self.compiled is not None:
            self._stats.recompiles = self.compiled.num_recompiles
        state = self.graphs.state
        if state is not None:
            later = state.num_graphs - self.graphs.graphs_at_startup
            self._stats.captures_after_startup = later + state.refused
        return self._stats

    def step(self, batch: Batch, *, clone: bool = True) -> torch.Tensor:
        """One forward step; returns the model's output rows for the batch's tokens, in the
        order the requests were given. A rejected batch changes nothing.

        A step that replays a graph leaves its output in the graph's own memory, which a
        later replay may overwrite; by default the rows come back in a new tensor.
        ``clone=False`` returns them in place, valid until the next step, as an engine that
        reads them at once wants (one copy kernel less, and 21-52 us less host time a step
        on the H200 machine).
        """
        if clone is not True and clone is not False:  # "no" or 0 would read as a choice
            raise InvalidInputError(f"clone must be True or False, got {clone!r}")
        with _inference_mode():
            if self._check_kv_writes:
                return self._step_checking_kv_writes(batch, clone)
            return self.runner.execute(batch, clone=clone)

    def _step_checking_kv_writes(self, batch: Batch, clone: bool) -> torch.Tensor:
        """``debug=True``'s first step: a backend none of whose layers' KV caches changed
        wrote nothing, which registration cannot see (it checks only where a backend says it
        writes). The cache starts zeroed, so any key or value written changes its
        fingerprint (unless every one written is exactly zero). A backend that wrote some of
        its layers and not others is not blamed: a model may hold a ga.Attention that it
        does not call."""
        before = {name: _fingerprint(t) for name, t in self.kv_cache.tensors.items()}
        out = self.runner.execute(batch, clone=clone)  # a rejected batch: checked next step
        self._check_kv_writes = False
        layers_of: dict[str, list[str]] = {}
        changed: set[str] = set()
        for name, t in self.kv_cache.tensors.items():
            backend = self.bound[name].backend.get_name()
            layers_of.setdefault(backend, []).append(name)
            if _fingerprint(t) != before[name]:
                changed.add(backend)
        silent = sorted(set(layers_of) - changed)
        if silent:
            layers = [n for b in silent for n in layers_of[b]]
            raise BackendError(
                f"debug=True: the first step had {batch.num_tokens} tokens' keys and values to "
                f"write, but the KV cache of no layer of backend {', '.join(silent)} changed "
                f"({len(layers)} layers: {_span_of(layers)}): its write does nothing (it "
                "belongs in forward when the backend's forward_includes_kv_cache_update is "
                "True, else in do_kv_cache_update), or every key and value it wrote was "
                "exactly zero, or the model calls none of these layers"
            )
        return out

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's ``compute_logits`` (``[T, H] -> [T, V]``), in inference mode (so
        ``ga.linear`` may take its GEMV, which autograd could not record)."""
        if not hasattr(self.model, "compute_logits"):
            raise InvalidInputError(
                f"{type(self.model).__name__} has no compute_logits(hidden); generate needs one"
            )
        if not (
            isinstance(hidden, torch.Tensor) and hidden.dim() == 2 and hidden.is_floating_point()
        ):  # a row picked as out[-1] (1-D), or token ids, would fail inside the head or pass
            raise InvalidInputError(
                f"compute_logits takes step rows [T, hidden] of a floating dtype (one row: "
                f"out[-1:], not out[-1]), got {arrived(hidden)}"
            )
        return self.model.compute_logits(hidden)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        eos_token_id: int | None = None,
    ) -> list[list[int]]:
        """Greedy decoding of every prompt with continuous batching; returns new tokens per prompt."""
        from graphattn.generation import generate

        return generate(self, prompts, max_new_tokens, eos_token_id=eos_token_id)

    # -- start-up ---------------------------------------------------------------------

    def _select_backends(self) -> dict[str, BoundLayer]:
        """Each layer's backend under this engine's settings, with the engine's own impl."""
        bound, self.selections, self.selected_by = {}, {}, {}
        for name, layer in self.layers.items():
            requested = layer.requested_backend or self.config.attention_backend
            cfg = layer.selector_config(
                self.dtype, self.kv_cache_dtype, self.config.block_size, self.device.type
            )
            selection = select_backend(cfg, requested)
            impl = layer.make_impl(selection.backend, self.kv_cache_dtype)
            bound[name] = BoundLayer(layer, selection.backend, impl)
            self.selections[name] = selection
            self.selected_by[name] = (
                "layer" if layer.requested_backend else "config" if requested else "auto"
            )
        return bound

    def _allocate_kv_cache(self) -> tuple[KVCache, list[AttentionGroup]]:
        specs = {
            n: b.layer.get_kv_cache_spec(self.config.block_size, self.kv_cache_dtype)
            for n, b in self.bound.items()
        }
        kernel_sizes = {
            n: b.backend.get_supported_kernel_block_sizes() for n, b in self.bound.items()
        }
        kv_groups = group_layers_by_spec(specs, kernel_sizes)

        def shape_of(name: str, group: KVCacheGroup, kernel_blocks: int) -> tuple[int, ...]:
            backend = self.bound[name].backend
            args = (kernel_blocks, group.kernel_block_size, group.spec.num_kv_heads)
            shape = backend.get_kv_cache_shape(*args, group.spec.head_size)
            return _checked_cache_shape(
                backend.get_name(), shape, (*args, group.spec.head_size), group.spec
            )

        # the builders first: what they allocate (split scratch) is then taken from the
        # memory the KV cache's size is checked against
        groups = build_attention_groups(kv_groups, self.bound)
        for group in groups:
            builder_cls = group.backend.get_builder_cls()
            group.builder = builder_cls(
                group.kv_cache_group.spec, group.layer_names, self.config, self.device
            )
            support = builder_cls.get_cudagraph_support(self.config, group.kv_cache_group.spec)
            if "cudagraph_support" in vars(group.builder):
                raise BackendError(
                    f"{builder_cls.__qualname__} ({group.backend.get_name()}) sets "
                    "cudagraph_support on an instance; the level is read from the class before "
                    "capture: declare it as a class attribute, or override the classmethod "
                    "get_cudagraph_support(config, kv_cache_spec)"
                )
            if not isinstance(support, AttentionCGSupport):
                raise BackendError(
                    f"{builder_cls.__qualname__} ({group.backend.get_name()}) declares CUDA-graph "
                    f"support {support!r}; expected an AttentionCGSupport "
                    f"({', '.join(level.name for level in AttentionCGSupport)})"
                )
            group.cudagraph_support = support
        kv_cache = KVCache(kv_groups, self.config.num_blocks, shape_of, self.device)
        for name, b in self.bound.items():
            b.kv_cache = kv_cache.tensors[name]
        return kv_cache, groups

    def _negotiate_mode(self) -> tuple[CUDAGraphMode, list[FallbackRecord]]:
        """The requested mode lowered to what every attention group allows; each lowering is
        a FallbackWarning, a log line and a record (or, with strict=True, an error).
        """
        weakest = min(self.attn_groups, key=lambda g: g.cudagraph_support)
        resolve = functools.partial(
            resolve_for_engine,
            self.config.cudagraph_mode,
            attention_is_splitting_op=self._attention_is_split(),
            has_decode_size=self.config.has_decode_capture_size(),
            uniform_decode_query_len=self.config.uniform_decode_query_len,
        )
        mode, records = resolve(
            weakest.cudagraph_support,
            has_cuda=self.device.type == "cuda",
            backend_name=weakest.backend.get_name(),
        )
        self.mode_on_cuda = None  # off CUDA: what the same request would get on a GPU
        if self.device.type != "cuda" and self.config.cudagraph_mode != CUDAGraphMode.NONE:
            self.mode_on_cuda = self._mode_on_cuda(resolve)
        for record in records:
            if self.config.strict:
                raise CUDAGraphModeError(f"strict=True forbids lowering the mode: {record}")
            logger.warning("%s", record)
            warnings.warn(str(record), FallbackWarning, stacklevel=4)
        return mode, records

    def _mode_on_cuda(self, resolve: Callable) -> str:
        """What the requested mode would resolve to on a CUDA device: each layer's backend
        selected again for CUDA (automatic selection ranks backends per device), then the
        weakest one's support level through ``resolve`` (``resolve_for_engine`` with this
        engine's request)."""
        weakest: tuple[AttentionCGSupport, str] | None = None
        for name, b in self.bound.items():
            requested = b.layer.requested_backend or self.config.attention_backend
            cfg = b.layer.selector_config(
                self.dtype, self.kv_cache_dtype, self.config.block_size, "cuda"
            )
            try:
                backend = select_backend(cfg, requested).backend
                spec = b.layer.get_kv_cache_spec(self.config.block_size, self.kv_cache_dtype)
                support = backend.get_builder_cls().get_cudagraph_support(self.config, spec)
            except GraphAttnError as e:
                return f"no backend for {name} ({e})"
            if not isinstance(support, AttentionCGSupport):
                return f"{backend.get_name()} declares CUDA-graph support {support!r}"
            if weakest is None or support < weakest[0]:
                weakest = (support, backend.get_name())
        assert weakest is not None  # an engine has attention layers
        try:
            _, records = resolve(weakest[0], has_cuda=True, backend_name=weakest[1])
        except CUDAGraphModeError as e:
            return f"{self.config.cudagraph_mode}: an error ({e})"
        if not records:
            return f"{self.config.cudagraph_mode}, kept (backend {weakest[1]})"
        return "; then ".join(str(r) for r in records)

    def _attention_is_split(self) -> bool:
        """True when the model is compiled piecewise with the attention op as a splitting op."""
        ops = self.config.splitting_ops
        attention = ATTENTION_OP._schema.name  # "graphattn::unified_attention_with_output"
        # the splitter's reading of a name: the op, or the op with any of its overloads
        return self.config.compile_backend != "none" and (
            ops is None or any(name.partition(".")[0] == attention for name in ops)
        )

    def _compile(self) -> CompiledForward | None:
        """Trace and compile the model piecewise (None with compile_backend="none").

        The trace runs as the profile run: real inputs from the persistent buffers and a
        forward context without metadata, so attention writes nothing to the cache.
        """
        wrong = call_error(self.model)
        if wrong is not None:
            raise InvalidInputError(wrong)
        if self.config.compile_backend == "none":
            _check_unused_compile_fields(self.config)
            self._profile_run()
            return None
        from graphattn.passes.compiler import CompileOptions, compile_model

        c = self.config
        options = CompileOptions(
            splitting_ops=c.splitting_ops,
            compile_backend=c.compile_backend,
            compile_sizes=self.compile_sizes,
            cache_dir=c.cache_dir,
            debug_dump_path=c.debug_dump_path,
            strict=c.strict or c.debug,
            cache_factors=self._cache_factors(),
            passes=c.passes,
            trace_cache=c.trace_cache,
            verify_trace_cache=c.debug,
            inductor_pdl=self.inductor_pdl,
            fold_o_proj=self.fold_o_proj,
        )
        n = c.max_num_tokens
        example = (self.runner.buffers.input_ids.gpu[:n], self.runner.buffers.positions.gpu[:n])
        with torch.inference_mode(), set_forward_context(None, layers=self.bound):
            return compile_model(
                self.model, options, example, piece_wrapper=self.graphs.piece_wrapper()
            )

    def _profile_run(self) -> None:
        """The uncompiled model's forward once, on up to 16 tokens with no metadata
        (attention writes nothing and reads nothing), as the compiled path's trace does: a
        model that returns other than one tensor, calls a ga.Attention twice, or hands one
        integer or mismatched query, key and value, or other than the forward's token count,
        fails at start-up, not after its first layers wrote a step's keys and values."""
        n = min(self.config.max_num_tokens, 16)
        ids, positions = (
            self.runner.buffers.input_ids.gpu[:n],
            self.runner.buffers.positions.gpu[:n],
        )
        context = set_forward_context(None, layers=self.bound)
        context.context.num_tokens = n  # no slot mapping here to count the tokens by
        with torch.inference_mode(), context:
            _one_tensor(self.model)(ids, positions)

    def _cache_factors(self) -> dict[str, Any]:
        """Everything about this engine that changes the compiled code."""
        c = self.config
        return {
            "dtype": str(self.dtype),
            "kv_cache_dtype": str(self.kv_cache_dtype),
            "device": torch.cuda.get_device_name(self.device)
            if self.device.type == "cuda"
            else "cpu",
            "backends": {n: b.backend.full_cls_name() for n, b in self.bound.items()},
            "splitting_ops": list(c.splitting_ops or ()),
            "compile_backend": c.compile_backend,
            "compile_sizes": list(self.compile_sizes),
            "passes": list(c.passes),
            "model": type(self.model).__qualname__,
        }

    def _limits(self) -> BatchLimits:
        c = self.config
        return BatchLimits(
            c.max_num_seqs,
            c.max_num_tokens,
            c.max_model_len,
            c.block_size,
            c.num_blocks,
            _declared_vocab(self.model),
            self.kv_cache.allocator if c.debug else None,
            _read_window(self.kv_cache),
        )

    def _make_report(self, seconds: float) -> Report:
        group_of = {n: g.group_id for g in self.attn_groups for n in g.layer_names}
        layers = [
            LayerInfo(
                n,
                b.backend.get_name(),
                group_of[n],
                self.selected_by[n],
                self.selections[n].rejected,
            )
            for n, b in self.bound.items()
        ]
        groups = [
            GroupInfo(
                g.group_id,
                g.backend.get_name(),
                g.kv_cache_group.group_id,
                g.kv_cache_group.spec.describe(),
                g.num_heads,
                g.kv_cache_group.kernel_block_size,
                list(g.layer_names),
                g.cudagraph_support.name,
            )
            for g in self.attn_groups
        ]
        kv = {
            "num_blocks": self.kv_cache.num_blocks,
            "block_size": self.kv_cache.block_size,
            "MiB": round(self.kv_cache.nbytes / 2**20, 1),
            "max_model_len": f"{self.config.max_model_len} ({self.max_model_len_from})",
        }
        return Report(
            str(self.device),
            str(self.dtype).removeprefix("torch."),
            str(self.requested_mode),
            str(self.resolved_mode),
            layers,
            groups,
            fallbacks=list(self.fallbacks),
            kv_cache=kv,
            compile=dataclasses.asdict(self.compiled.info) if self.compiled else {},
            capture=self.capture_info,
            kernels=dict(self.kernel_settings),
            startup_seconds=seconds,
            mode_on_cuda=self.mode_on_cuda,
            uniform_decode_query_len=self.config.uniform_decode_query_len,
        )


_INFERENCE_MODE_GUARD = getattr(torch._C, "_InferenceMode", None)


def _kernel_settings(device: torch.device) -> dict[str, str]:
    """How graphattn's kernels launch on ``device``, as the environment sets it: PDL
    (``GRAPHATTN_PDL``) and where split-KV results merge (``GRAPHATTN_FUSED_SPLIT_MERGE``)."""
    try:
        merge = attention_plan.describe_merge()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    envs.inductor_pdl()  # read now, so a bad value fails before anything is allocated
    envs.fold_o_proj()
    envs.prefetch_mib()  # read again by the prefetch pass, if it is named, when it runs
    envs.check_pdl()
    return {"pdl": pdl.describe(device), "split_kv_merge": merge}


def _inductor_pdl(device: torch.device, mode: CUDAGraphMode, backend: str) -> tuple[bool, str]:
    """Whether Inductor's Triton kernels in the compiled pieces launch with PDL, and the
    report's line for it. Only where the engine captures CUDA graphs: a kernel launched with
    PDL cannot take Inductor's static launcher (Triton's launches it), which a replay never
    calls and eager steps were not measured with. An Inductor kernel waits ahead of its first
    read of what the kernel before it wrote (a piece's first kernel, ahead of any read) and
    signals its dependents only after a wait; graphattn's kernels wait before every read of
    what a kernel of the step wrote (``kernels/pdl.py``), and the two that signal before
    their wait, decode attention and the split-KV reduction, are splitting ops: a piece's
    first kernel comes after them.
    """
    if backend != "inductor":
        return False, f"off: compile_backend={backend!r} runs no Inductor"
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config.triton, "enable_pdl"):
        return False, f"off: torch {torch.__version__} has no triton.enable_pdl in Inductor"
    if inductor_config.triton.enable_pdl:  # graphattn patches nothing then
        return False, "on: Inductor's own config (TORCHINDUCTOR_ENABLE_PDL)"
    if not envs.inductor_pdl():
        return False, "off: GRAPHATTN_INDUCTOR_PDL=0"
    if not pdl.use_pdl(device):
        return False, "off: graphattn's kernels launch without PDL"
    if mode == CUDAGraphMode.NONE:
        return False, "off: no CUDA graphs (resolved mode NONE)"
    return True, "on (graphattn's builds set Inductor's triton.enable_pdl)"


def _fold_o_proj(backend: str) -> tuple[bool, str]:
    """Whether the trace is rewritten so that each attention op runs its layer's o_proj
    (``passes/o_proj_fold.py``), and the report's line for it; how many layers it rewrote is
    ``report.compile["o_proj_folded"]``."""
    if not envs.fold_o_proj():
        return False, "off (GRAPHATTN_FOLD_O_PROJ=1 folds o_proj into the attention op)"
    if backend == "none":
        return False, "off: compile_backend='none' traces no graph to rewrite"
    return True, (
        "on (GRAPHATTN_FOLD_O_PROJ=1): each attention + o_proj that matches is rewritten "
        "(compile.o_proj_folded counts them)"
    )


def _precompile_skip(compiled: CompiledForward | None) -> str | None:
    """Why the capture need not compile graphattn's kernels ahead (``kernels/precompile.py``),
    or None: after a warm compile Triton's cache most likely holds them too, and the dry
    pass over every capture key would only add its own time."""
    if compiled is not None and compiled.info.warm:
        return precompile.WARM_SKIP
    return None


def _input_staging() -> tuple[str, str | None]:
    """How full graphs stage their inputs (``envs.input_staging``), and why not as asked:
    the staging kernel is a Triton kernel, so without Triton the graphs copy (reported in
    ``report.capture``, and logged)."""
    staging = envs.input_staging()
    missing = triton_import_error() if staging == "kernel" else None
    if missing is not None:
        note = f"the staging kernel needs Triton, which cannot be imported ({missing})"
        logger.warning("input staging: three memcpy nodes instead of one kernel (%s)", note)
        return "copies", note
    return staging, None


def _read_window(kv_cache: KVCache) -> int | None:
    """How far back any layer reads: the largest window where every layer slides, else None."""
    specs = [g.spec for g in kv_cache.groups]
    if specs and all(isinstance(s, SlidingWindowSpec) for s in specs):
        return max(s.sliding_window for s in specs)
    return None


def _inference_mode() -> Any:
    """``torch.inference_mode()`` without the Python wrapper around it when torch has the
    C++ guard (a microsecond or more of every decode step's host time).
    """
    if _INFERENCE_MODE_GUARD is not None:
        return _INFERENCE_MODE_GUARD(True)
    return torch.inference_mode()


def _one_tensor(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The uncompiled model's forward, checked as the compiled path checks its trace: one
    tensor of hidden states out, a row per token (a tuple, or a batch dimension in front,
    would fail later, far from the cause, after the step's keys and values were written)."""

    def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = model(input_ids, positions)
        wrong = output_error(model, out, input_ids.shape[0])
        if wrong is not None:
            raise InvalidInputError(wrong)
        return out

    return forward


def find_attention_layers(model: nn.Module) -> dict[str, Attention]:
    """Every ``ga.Attention`` in ``model`` by its layer name (its ``prefix``), in module order."""
    layers: dict[str, Attention] = {}
    for module in model.modules():
        if isinstance(module, Attention):
            if module.layer_name in layers:
                raise ConfigError(
                    f"two attention layers share the name {module.layer_name!r}; give each "
                    "ga.Attention a unique prefix"
                )
            layers[module.layer_name] = module
    if not layers:
        raise ConfigError(
            f"{type(model).__name__} has no ga.Attention layer; graphattn serves models whose "
            "attention goes through ga.Attention"
        )
    return layers


def _checked_cache_shape(
    backend: str, shape: object, args: tuple[int, int, int, int], spec: FullAttentionSpec
) -> tuple[int, ...]:
    """A backend's ``get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)``,
    which must hold the spec's entries for every slot (a key and a value per KV head: 2 x
    the product of the arguments; an MLA layer's one entry: the product), in whatever layout
    the backend reads."""
    ints = isinstance(shape, (tuple, list, torch.Size)) and all(
        isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape
    )
    blocks, block_size = args[0], args[1]
    expected = blocks * block_size * spec.elements_per_slot
    if not ints or math.prod(shape) != expected:
        what = (
            f"{' x '.join(map(str, args))} = {expected} elements (one entry per slot)"
            if isinstance(spec, MLAAttentionSpec)
            else f"2 x {' x '.join(map(str, args))} = {expected} elements (a key and a value "
            "per slot)"
        )
        raise BackendError(
            f"{backend}.get_kv_cache_shape{args} must be a shape of positive ints with "
            f"{what}, got {shape!r}"
        )
    return tuple(shape)


def _check_unused_compile_fields(config: CompileConfig) -> None:
    """compile_backend="none" reads no pass, splitting op or compile size: names set there
    are still checked (so a typo does not wait for the day the model is compiled), and the
    log says they are unused."""
    from graphattn.config import DEFAULT_PASSES

    unused = []
    if tuple(config.passes) != DEFAULT_PASSES:
        from graphattn.passes.pass_manager import make_pass_manager

        make_pass_manager(config.passes)
        unused.append("passes")
    if config.splitting_ops is not None:
        from graphattn.passes.split import resolve_splitting_ops

        resolve_splitting_ops(config.splitting_ops)
        unused.append("splitting_ops")
    if config.compile_sizes is not None:
        unused.append("compile_sizes")
    if unused:
        logger.warning("%s set with compile_backend='none', which compiles nothing: unused", unused)


def _declared_vocab(model: nn.Module) -> int | None:
    """The vocabulary token ids are checked against: ``model.vocab_size``, else
    ``model.config.vocab_size`` (the Hugging Face convention); None (no check) if neither
    is a positive int."""
    for owner in (model, getattr(model, "config", None)):
        value = getattr(owner, "vocab_size", None)
        if is_int(value) and value > 0:  # numpy ints too
            return int(value)
    return None


def _declared_positions(model: nn.Module) -> int | None:
    """The positions the model says it can embed (``model.config.max_position_embeddings``,
    the Hugging Face convention graphattn's models follow), or None."""
    value = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _device_and_dtype(model: nn.Module, config: CompileConfig) -> tuple[torch.device, torch.dtype]:
    params = [p for p in model.parameters() if p.is_floating_point()]
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise InvalidInputError(
            f"the model's parameters are spread over {sorted(map(str, devices))}; "
            "move the model to one device"
        )
    device = params[0].device if params else torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtypes = {p.dtype for p in params}
    model_dtype = params[0].dtype if len(dtypes) == 1 else None
    if len(dtypes) > 1 and config.dtype is None:
        counts: dict[torch.dtype, int] = {}
        for p in params:
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
        found = ", ".join(f"{d} ({n} values)" for d, n in sorted(counts.items(), key=str))
        raise InvalidInputError(
            f"the model's floating-point parameters mix dtypes: {found}; pass dtype= to say "
            f"which one its activations and KV cache use"
        )
    dtype = config.dtype or model_dtype or torch.get_default_dtype()
    if model_dtype is not None and dtype != model_dtype:
        raise InvalidInputError(
            f"dtype={dtype} was asked for but the model's parameters are {model_dtype}; "
            f"convert the model first (model.to({dtype}))"
        )
    if device.type not in ("cpu", "cuda"):
        raise InvalidInputError(f"the model is on {device}; graphattn runs on cpu or cuda")
    return device, dtype


def _fingerprint(t: torch.Tensor, chunk: int = 1 << 22) -> int:
    """A sum over the tensor's bits (int32 words where its bytes allow): changed by any
    write of values other than those it held. Summed a chunk at a time, so the int64
    copies the sums make stay small beside a cache of many GiB."""
    raw = t.detach().reshape(-1).view(torch.uint8)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), chunk):
        total += words[start : start + chunk].sum(dtype=torch.int64)
    return int(total)


def _span_of(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 3 else f"{names[0]} ... {names[-1]}"
