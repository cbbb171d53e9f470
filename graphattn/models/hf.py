"""Load Hugging Face Llama, Qwen2 and DeepSeek-V2 checkpoints into graphattn's models.

``load(source)`` takes a local checkpoint folder (``config.json`` and safetensors, one file
or shards listed in ``model.safetensors.index.json``) or an in-memory transformers model.
It turns the config into a ``LlamaConfig`` (Llama, Qwen2) or an ``MLAConfig``
(DeepSeek-V2), checks every tensor's name and shape against the model that config
describes before allocating anything, then copies the weights in: q/k/v stacked into
``qkv_proj``, gate/up into ``gate_up_proj``, and a DeepSeek checkpoint's experts (one
tensor per expert, or transformers 5's stacked ones) into the stacked expert weights, with
the rotary rows of its query and key projections reordered from interleaved pairs to
halves. Nothing is downloaded, and neither transformers nor safetensors is imported until a
checkpoint needs it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from graphattn.config import parse_dtype
from graphattn.errors import ConfigError, GraphAttnError
from graphattn.models.llama import (
    ROPE_NEEDS,
    ROPE_OPTIONAL,
    LlamaConfig,
    LlamaForCausalLM,
    RotaryEmbedding,
)
from graphattn.models.mla import MLAConfig, MLAForCausalLM

# Hugging Face architecture name -> family: llama and qwen2 load into LlamaForCausalLM,
# deepseek_v2 into MLAForCausalLM.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "DeepseekV2ForCausalLM": "deepseek_v2",
}
_TOPK_METHODS = ("greedy", "group_limited_greedy")
# graphattn's merged projections and the Hugging Face projections stacked into them, in order.
_MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# Buffers some older checkpoints saved; graphattn recomputes them from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_LIST_LIMIT = 5  # names listed per kind of mismatch; the rest are counted


class ModelLoadError(GraphAttnError, ValueError):
    """A checkpoint cannot be loaded: no such folder, no config or safetensors, a bad config."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's architecture, or a feature its config turns on, is not supported."""


class WeightMismatchError(ModelLoadError):
    """The checkpoint's tensors do not match the model its config describes.

    ``missing``, ``unexpected`` and ``mismatched`` (name, expected shape, got shape) hold
    every offending tensor; the message lists the first few of each.
    """

    def __init__(
        self,
        message: str,
        missing: list[str],
        unexpected: list[str],
        mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]],
    ) -> None:
        super().__init__(message)
        self.missing, self.unexpected, self.mismatched = missing, unexpected, mismatched


def load(
    source: str | os.PathLike[str] | nn.Module,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
) -> LlamaForCausalLM:
    """graphattn's ``LlamaForCausalLM`` with the weights of a Llama or Qwen2 checkpoint, or
    its ``MLAForCausalLM`` (a subclass) with those of a DeepSeek-V2 checkpoint.

    ``source`` is a local folder (``config.json`` + safetensors) or a transformers
    ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``DeepseekV2ForCausalLM``. ``dtype`` defaults to the checkpoint's
    (the embedding's dtype); ``device`` to the CPU for a folder, the model's device for a
    model. Raises ``UnsupportedModelError`` for an architecture or config feature graphattn
    does not implement and ``WeightMismatchError`` naming every missing, unexpected or
    mis-shaped tensor.
    """
    wanted_dtype = parse_dtype(dtype, "dtype")  # the arguments first, before any file
    wanted_device = _device(device)
    checkpoint = _open_module(source) if isinstance(source, nn.Module) else _open_folder(source)
    cfg = config_from_hf(checkpoint.config, checkpoint.architecture)
    model_cls = MLAForCausalLM if isinstance(cfg, MLAConfig) else LlamaForCausalLM
    with torch.device("meta"):  # shapes only: nothing is allocated until the checks pass
        model = model_cls(cfg)
    slots = _per_expert_slots(weight_slots(model, cfg), checkpoint.shapes)
    check_tensors(slots, checkpoint.shapes, cfg, checkpoint.architecture)
    target_dtype = wanted_dtype or checkpoint.dtype
    model = _materialize(model, cfg, target_dtype, wanted_device or checkpoint.device)
    _copy_weights(model, slots, checkpoint.tensors())
    if isinstance(cfg, MLAConfig):
        _rotary_rows_to_halves(model, cfg)
    return model.eval().requires_grad_(False)


def _device(device: torch.device | str | None) -> torch.device | None:
    """``load``'s ``device``, checked before anything is read or allocated."""
    if device is None:
        return None
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelLoadError(
            f"device must be a torch.device or its name ('cpu', 'cuda', 'cuda:1'), got {device!r}"
        ) from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {str(parsed)!r}, but this torch sees no CUDA device")
    return parsed


# -- sources --------------------------------------------------------------------------


@dataclass
class _Checkpoint:
    """What ``load`` needs from a source: config, names and shapes, and the tensors."""

    config: dict[str, Any]
    architecture: str
    shapes: dict[str, tuple[int, ...]]
    dtype: torch.dtype
    device: torch.device
    tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]]


def _open_module(model: nn.Module) -> _Checkpoint:
    """An in-memory transformers model: its config and state dict."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise UnsupportedModelError(
            f"expected a transformers model (with a .config), got {type(model).__name__}"
        )
    state = model.state_dict()
    embedding = state.get("model.embed_tokens.weight")
    return _Checkpoint(
        config=config.to_dict(),
        architecture=type(model).__name__,
        shapes={name: tuple(t.shape) for name, t in state.items()},
        dtype=_default_dtype(embedding.dtype if embedding is not None else None),
        device=embedding.device if embedding is not None else torch.device("cpu"),
        tensors=lambda: state.items(),
    )


def _open_folder(path: str | os.PathLike[str]) -> _Checkpoint:
    """A local checkpoint folder: ``config.json`` and its safetensors file(s)."""
    if not isinstance(path, (str, os.PathLike)):
        raise ModelLoadError(
            "graphattn.models.load takes a checkpoint folder (a str or a path) or a "
            f"transformers model, got {type(path).__name__}"
        )
    folder = Path(path)
    if not folder.is_dir():
        raise ModelLoadError(
            f"{str(path)!r} is not a local folder; graphattn.models.load reads a checkpoint "
            "folder (config.json + *.safetensors) or a transformers model and never downloads"
        )
    config = _read_config(folder)
    files = _safetensors_files(folder)
    shapes, dtypes = _read_headers(files)
    return _Checkpoint(
        config=config,
        architecture=_architecture(config, folder),
        shapes=shapes,
        dtype=_default_dtype(dtypes.get("model.embed_tokens.weight")),
        device=torch.device("cpu"),
        tensors=lambda: _read_tensors(files),
    )


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder} has no config.json; expected a Hugging Face checkpoint")
    config = _read_json(path)
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())  # UTF-8, -16 or -32, as JSON allows
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None


def _architecture(config: dict[str, Any], folder: Path) -> str:
    names = config.get("architectures") or []
    if len(names) != 1:
        raise UnsupportedModelError(
            f"{folder / 'config.json'} must name one architecture, got architectures={names!r}; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    return names[0]


def _weight_map(index: Path) -> dict[str, str]:
    """The index's ``weight_map`` (tensor name -> shard file name), or what is wrong with it."""
    data = _read_json(index)
    if not isinstance(data, dict):
        got = f"a {type(data).__name__}"
    elif "weight_map" not in data:
        got = "an object without 'weight_map'"
    elif not isinstance(weight_map := data["weight_map"], dict):
        got = f"a 'weight_map' that is a {type(weight_map).__name__}"
    elif bad := [k for k, v in weight_map.items() if not isinstance(v, str)]:
        got = f"{bad[0]!r} mapped to {weight_map[bad[0]]!r}"
    else:
        return weight_map
    raise ModelLoadError(
        f"{index} must hold a JSON object whose 'weight_map' maps tensor names to shard file "
        f"names, got {got}"
    )


def _safetensors_files(folder: Path) -> list[Path]:
    """The shards named by ``model.safetensors.index.json``, else ``model.safetensors``."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _weight_map(index)
        files = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"{index.name} lists shards missing from {folder}: {absent}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    present = sorted(p.name for p in folder.iterdir())
    raise ModelLoadError(
        f"{folder} has neither model.safetensors nor model.safetensors.index.json "
        f"(found {present}); only safetensors checkpoints are read"
    )


def _safe_open(path: Path) -> Any:
    try:
        from safetensors import safe_open
    except ImportError as e:
        raise ImportError(
            "reading a checkpoint folder needs the safetensors package: "
            "pip install -e '.[hf]' in the graphattn checkout (or pip install safetensors)"
        ) from e
    return safe_open(str(path), framework="pt", device="cpu")


def _read_headers(files: list[Path]) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Every tensor's shape and dtype from the safetensors headers (no tensor data read)."""
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for path in files:
        with _safe_open(path) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                tensor_slice = f.get_slice(name)
                shapes[name] = tuple(tensor_slice.get_shape())
                dtypes[name] = tensor_slice.get_dtype()
    return shapes, dtypes


def _read_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with _safe_open(path) as f:
            for name in f.keys():  # noqa: SIM118
                yield name, f.get_tensor(name)


def _default_dtype(stored: torch.dtype | str | None) -> torch.dtype:
    """The stored dtype where the engine runs it (fp16, bf16, fp32), else float32."""
    if isinstance(stored, str):
        stored = _SAFETENSORS_DTYPES.get(stored)
    return stored if stored in _SAFETENSORS_DTYPES.values() else torch.float32


# -- config ---------------------------------------------------------------------------


def config_from_hf(hf: dict[str, Any], architecture: str) -> LlamaConfig | MLAConfig:
    """graphattn's ``LlamaConfig`` (``MLAConfig`` for DeepSeek-V2) for a Hugging Face config
    dict (``config.json``).

    Reads rope settings both as transformers 5 writes them (``rope_parameters``) and as
    transformers 4 did (``rope_theta`` + ``rope_scaling``).
    """
    family = SUPPORTED_ARCHITECTURES.get(architecture)
    if family is None:
        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported; graphattn loads "
            f"{sorted(SUPPORTED_ARCHITECTURES)}"
        )
    _check_features(hf, family, architecture)
    theta, scaling = rope_settings(hf, architecture)
    if family == "deepseek_v2":
        return _mla_config(hf, architecture, theta, scaling)
    heads = _field(hf, "num_attention_heads", architecture)
    hidden = _field(hf, "hidden_size", architecture)
    return LlamaConfig(
        vocab_size=_field(hf, "vocab_size", architecture),
        hidden_size=hidden,
        intermediate_size=_field(hf, "intermediate_size", architecture),
        num_hidden_layers=_field(hf, "num_hidden_layers", architecture),
        num_attention_heads=heads,
        num_key_value_heads=_field(hf, "num_key_value_heads", architecture, heads),
        head_dim=_field(hf, "head_dim", architecture, hidden // heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_field(hf, "max_position_embeddings", architecture),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=family == "qwen2",  # Qwen2 always has q/k/v biases
    )


def _mla_config(
    hf: dict[str, Any], architecture: str, theta: float, scaling: dict[str, Any] | None
) -> MLAConfig:
    def size(name: str, default: int | None = None) -> int:
        return _field(hf, name, architecture, default)

    experts = hf.get("n_routed_experts")
    moe: dict[str, Any] = {}
    if experts is not None:  # transformers' DeepseekV2 always has experts; a config may not
        groups = hf.get("n_group") if hf.get("topk_method") == "group_limited_greedy" else None
        moe = dict(
            n_routed_experts=size("n_routed_experts"),
            num_experts_per_tok=size("num_experts_per_tok"),
            moe_intermediate_size=size("moe_intermediate_size"),
            n_shared_experts=_count(hf, "n_shared_experts", architecture),
            first_k_dense_replace=_count(hf, "first_k_dense_replace", architecture),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            topk_method=hf.get("topk_method", "greedy"),
            n_group=groups,
            topk_group=hf.get("topk_group") if groups is not None else None,
        )
    q_lora = hf.get("q_lora_rank")
    try:
        return MLAConfig(
            vocab_size=size("vocab_size"),
            hidden_size=size("hidden_size"),
            intermediate_size=size("intermediate_size"),
            num_hidden_layers=size("num_hidden_layers"),
            num_attention_heads=size("num_attention_heads"),
            q_lora_rank=None if q_lora is None else size("q_lora_rank"),
            kv_lora_rank=size("kv_lora_rank"),
            qk_nope_head_dim=size("qk_nope_head_dim"),
            qk_rope_head_dim=size("qk_rope_head_dim"),
            v_head_dim=size("v_head_dim"),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=size("max_position_embeddings"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            **moe,
        )
    except ConfigError as e:
        raise ModelLoadError(f"the {architecture} config: {e}") from None


def _count(hf: dict[str, Any], name: str, architecture: str) -> int:
    """A count the config may leave out (0) or set to 0: an int >= 0."""
    value = hf.get(name) or 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ModelLoadError(
            f"the {architecture} config's {name} must be an int >= 0, got {value!r}"
        )
    return value


def _field(hf: dict[str, Any], name: str, architecture: str, default: int | None = None) -> int:
    """A size the config must hold (or ``default`` where it may leave it out): an int > 0."""
    value = hf.get(name)
    if value is None:
        if default is None:
            raise ModelLoadError(f"the {architecture} config has no {name!r}")
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(
            f"the {architecture} config's {name} must be an int > 0, got {value!r}"
        )
    return value


def _check_features(hf: dict[str, Any], family: str, architecture: str) -> None:
    """Reject config settings whose computation graphattn's model does not implement."""

    def unsupported(what: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{architecture} with {what} is not supported")

    if hf.get("hidden_act", "silu") != "silu":
        raise unsupported(f"hidden_act={hf['hidden_act']!r} (expected 'silu')")
    if family in ("llama", "deepseek_v2") and hf.get("attention_bias"):
        raise unsupported("attention_bias=True (projection biases; expected False)")
    if family == "deepseek_v2":
        _check_moe_features(hf, unsupported)
    if hf.get("mlp_bias"):
        raise unsupported("mlp_bias=True (expected False)")
    if hf.get("use_sliding_window") and not hf.get("layer_types") and _some_layer_slides(hf):
        raise unsupported(
            f"use_sliding_window=True (sliding_window={hf.get('sliding_window')}, "
            f"max_window_layers={hf.get('max_window_layers')}, num_hidden_layers="
            f"{hf.get('num_hidden_layers')}; expected full attention)"
        )
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise unsupported(f"layer_types {sorted(layer_types)} (expected only 'full_attention')")


def _check_moe_features(hf: dict[str, Any], unsupported) -> None:
    """DeepSeek-V2's router as transformers computes it: softmax scores, greedy or
    group-limited top-k, no renormalisation of the picked weights, every layer from
    ``first_k_dense_replace`` on a mixture of experts."""
    if hf.get("n_routed_experts") is None:
        return
    if hf.get("topk_method", "greedy") not in _TOPK_METHODS:
        raise unsupported(
            f"topk_method={hf['topk_method']!r} (expected one of {list(_TOPK_METHODS)})"
        )
    if hf.get("norm_topk_prob"):
        raise unsupported(
            "norm_topk_prob=True (the picked experts' weights renormalised; expected False)"
        )
    if hf.get("scoring_func", "softmax") != "softmax":
        raise unsupported(f"scoring_func={hf['scoring_func']!r} (expected 'softmax')")
    if hf.get("moe_layer_freq", 1) != 1:
        raise unsupported(f"moe_layer_freq={hf['moe_layer_freq']!r} (expected 1)")


def _some_layer_slides(hf: dict[str, Any]) -> bool:
    """Under ``use_sliding_window``, transformers' Qwen2 slides layers ``max_window_layers``
    and up when ``sliding_window`` is set; a config where that leaves no layer is full
    attention. Without ``max_window_layers`` every layer is taken to slide.
    """
    if hf.get("sliding_window") is None:
        return False
    first, layers = hf.get("max_window_layers"), hf.get("num_hidden_layers")
    return not (isinstance(first, int) and isinstance(layers, int) and first >= layers)


def rope_settings(hf: dict[str, Any], architecture: str) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from either config layout; None scaling means default."""
    params = _flat_rope_params(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta") or 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_NEEDS:
        raise UnsupportedModelError(
            f"{architecture} with rope type {kind!r} is not supported (expected one of "
            f"{list(ROPE_NEEDS)}; rope settings {params})"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(
            f"{architecture} with partial_rotary_factor={params['partial_rotary_factor']} is "
            "not supported (expected 1.0)"
        )
    needed = ROPE_NEEDS[kind]
    absent = [key for key in needed if params.get(key) is None]
    if absent:
        raise ModelLoadError(f"{architecture} rope type {kind!r} needs {absent}; got {params}")
    if kind == "default":
        return theta, None
    # YaRN's truncate (a bool) rides along with its numbers
    takes = (*ROPE_OPTIONAL.get(kind, ()), *(("truncate",) if kind == "yarn" else ()))
    optional = [key for key in takes if params.get(key) is not None]
    return theta, {"rope_type": kind, **{key: params[key] for key in (*needed, *optional)}}


def _flat_rope_params(params: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 may nest rope settings per layer type; one shared setting is fine."""
    if not params or not all(isinstance(v, dict) for v in params.values()):
        return dict(params)
    distinct = {json.dumps(v, sort_keys=True) for v in params.values()}
    if len(distinct) != 1:
        raise UnsupportedModelError(f"rope settings that differ per layer type: {params}")
    return dict(next(iter(params.values())))


# -- weights --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Slot:
    """Where one checkpoint tensor goes: rows ``start : start + shape[0]`` of ``param``, or of
    ``param[expert]`` (one expert's tensor of a stacked expert weight)."""

    param: str
    start: int
    shape: tuple[int, ...]
    expert: int | None = None


def weight_slots(model: LlamaForCausalLM, cfg: LlamaConfig | MLAConfig) -> dict[str, _Slot]:
    """Hugging Face tensor name -> its slot in graphattn's model, for every tensor needed
    (stacked experts under transformers 5's names; ``_per_expert_slots`` turns them into a
    checkpoint's per-expert names).

    A tied head shares the embedding's parameter, so it needs no tensor of its own.
    """
    slots: dict[str, _Slot] = {}
    for name, param in model.named_parameters():  # a tied lm_head is listed once, as embed
        hf_name = name if name.startswith("lm_head.") else f"model.{name}"
        *_, module, leaf = hf_name.split(".")
        if module not in _MERGED:
            slots[hf_name] = _Slot(name, 0, tuple(param.shape))
            continue
        if module == "qkv_proj":
            d, hq, hk = cfg.head_size, cfg.num_attention_heads, cfg.kv_heads
            parts: tuple[int, ...] = (hq * d, hk * d, hk * d)
        else:  # gate_up_proj: gate and up halves (a layer's MLP, or its shared experts)
            parts = (param.shape[0] // 2,) * 2
        parent = hf_name.rsplit(".", 2)[0]
        start = 0
        for part, rows in zip(_MERGED[module], parts):
            slots[f"{parent}.{part}.{leaf}"] = _Slot(name, start, (rows, *param.shape[1:]))
            start += rows
        assert start == param.shape[0], f"{name}: parts add up to {start} rows"
    return slots


def _per_expert_slots(
    slots: dict[str, _Slot], shapes: dict[str, tuple[int, ...]]
) -> dict[str, _Slot]:
    """Where the checkpoint holds one tensor per expert (DeepSeek's own layout:
    ``mlp.experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``) instead of
    transformers 5's stacked ``mlp.experts.gate_up_proj`` / ``down_proj``: the slots of
    those names, into the stacked weights. Each layer takes the layout its checkpoint has."""
    out = dict(slots)
    per_expert = {m.group(1) for m in map(_EXPERT_TENSOR.match, shapes) if m}  # their parents
    for name, slot in slots.items():
        parent, _, leaf = name.rpartition(".")
        if not parent.endswith(".mlp.experts") or leaf not in ("gate_up_proj", "down_proj"):
            continue
        if name in shapes or parent not in per_expert:
            continue  # stacked, or neither layout (then the stacked names are missing)
        del out[name]
        num_experts, rows, cols = slot.shape
        per = rows // len(_EXPERT_PARTS[leaf])
        for e in range(num_experts):
            for i, part in enumerate(_EXPERT_PARTS[leaf]):
                out[f"{parent}.{e}.{part}.weight"] = _Slot(slot.param, i * per, (per, cols), e)
    return out


_EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
_EXPERT_TENSOR = re.compile(r"(.*\.mlp\.experts)\.\d+\.")  # one expert's tensor, by its parent


def check_tensors(
    slots: dict[str, _Slot],
    shapes: dict[str, tuple[int, ...]],
    cfg: LlamaConfig | MLAConfig,
    architecture: str,
) -> None:
    """Every needed tensor present with its shape, and nothing else; else one error naming all."""
    expected = {name: slot.shape for name, slot in slots.items()}
    if cfg.tie_word_embeddings and "lm_head.weight" in shapes:  # some tied checkpoints save it
        expected["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(
        name for name in set(shapes) - set(expected) if not name.endswith(_IGNORED_SUFFIXES)
    )
    mismatched = [
        (name, expected[name], tuple(shapes[name]))
        for name in sorted(set(expected) & set(shapes))
        if tuple(shapes[name]) != expected[name]
    ]
    if missing or unexpected or mismatched:
        header = _describe(cfg, architecture)
        message = _mismatch_message(header, missing, unexpected, mismatched, expected, shapes)
        raise WeightMismatchError(message, missing, unexpected, mismatched)


def _describe(cfg: LlamaConfig | MLAConfig, architecture: str) -> str:
    if isinstance(cfg, MLAConfig):
        experts = (
            f", {cfg.n_routed_experts} experts of {cfg.moe_intermediate_size} from layer "
            f"{cfg.first_k_dense_replace} (+{cfg.n_shared_experts} shared)"
            if cfg.n_routed_experts is not None
            else ""
        )
        shape = (
            f"heads={cfg.num_attention_heads}, kv_lora_rank={cfg.kv_lora_rank}, "
            f"q_lora_rank={cfg.q_lora_rank}, head dims {cfg.qk_nope_head_dim}+"
            f"{cfg.qk_rope_head_dim}/{cfg.v_head_dim}{experts}"
        )
    else:
        shape = f"heads={cfg.num_attention_heads}/{cfg.kv_heads} of size {cfg.head_size}"
    return (
        f"the checkpoint does not match the {architecture} its config describes "
        f"(hidden_size={cfg.hidden_size}, intermediate_size={cfg.intermediate_size}, "
        f"layers={cfg.num_hidden_layers}, {shape}, vocab_size={cfg.vocab_size}):"
    )


def _mismatch_message(header, missing, unexpected, mismatched, expected, shapes) -> str:
    lines = [header]
    kinds = [
        ("missing tensors", [f"{n} (expected shape {list(expected[n])})" for n in missing]),
        ("unexpected tensors", [f"{n} (shape {list(shapes[n])})" for n in unexpected]),
        ("wrong shapes", [f"{n}: expected {list(e)}, got {list(g)}" for n, e, g in mismatched]),
    ]
    for kind, items in kinds:
        if items:
            more = f" and {len(items) - _LIST_LIMIT} more" if len(items) > _LIST_LIMIT else ""
            lines.append(f"  {kind}: {', '.join(items[:_LIST_LIMIT])}{more}")
    return "\n".join(lines)


def _materialize(
    model: LlamaForCausalLM, cfg: LlamaConfig | MLAConfig, dtype: torch.dtype, device: torch.device
) -> LlamaForCausalLM:
    """Real (uninitialised) storage for the meta model; rotary caches computed again.

    Every parameter is overwritten by ``_copy_weights``; the rotary caches are buffers
    derived from the config, not checkpoint tensors. Their dtype follows the model's, as
    ``model.to(dtype)`` would leave it.
    """
    model = model.to(dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty may give the two names separate storage
        model.lm_head.weight = model.embed_tokens.weight
    rope = type(model).make_rotary_emb(cfg)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.cos_sin_cache.copy_(rope.cos_sin_cache)
    return model


@torch.no_grad()
def _copy_weights(
    model: LlamaForCausalLM,
    slots: dict[str, _Slot],
    tensors: Iterable[tuple[str, torch.Tensor]],
) -> None:
    params = dict(model.named_parameters())
    for name, tensor in tensors:
        slot = slots.get(name)
        if slot is not None:  # names were checked; the rest is a tied head or ignored buffers
            param = params[slot.param] if slot.expert is None else params[slot.param][slot.expert]
            param[slot.start : slot.start + slot.shape[0]].copy_(tensor)


@torch.no_grad()
def _rotary_rows_to_halves(model: MLAForCausalLM, cfg: MLAConfig) -> None:
    """DeepSeek rotates interleaved pairs (dims 2i and 2i+1 by frequency i); graphattn's
    rotary rotates halves (dims i and i + r/2). Reordering the rotary rows of the query
    projection (each head's last ``qk_rope_head_dim`` rows) and of the key's part of
    ``kv_a_proj_with_mqa`` as evens then odds gives the same rotations, and as queries and
    keys are reordered alike, the same scores."""
    r, nope = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim
    order = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)])
    for layer in model.layers:
        attn = layer.self_attn
        q = attn.q_proj if cfg.q_lora_rank is None else attn.q_b_proj
        rows = q.weight.view(cfg.num_attention_heads, nope + r, -1)
        rows[:, nope:] = rows[:, nope:][:, order.to(rows.device)]
        kv = attn.kv_a_proj_with_mqa.weight
        kv[cfg.kv_lora_rank :] = kv[cfg.kv_lora_rank :][order.to(kv.device)]
