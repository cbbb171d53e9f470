"""Load Hugging Face Llama and Qwen2 checkpoints into graphattn's ``LlamaForCausalLM``.

``load(source)`` takes a local checkpoint folder (``config.json`` and safetensors, one file
or shards listed in ``model.safetensors.index.json``) or an in-memory transformers model.
It turns the config into a ``LlamaConfig``, checks every tensor's name and shape against
the model that config describes before allocating anything, then copies the weights in:
q/k/v stacked into ``qkv_proj`` and gate/up into ``gate_up_proj``. Nothing is downloaded,
and neither transformers nor safetensors is imported until a checkpoint needs it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from graphattn.config import parse_dtype
from graphattn.errors import GraphAttnError
from graphattn.models.llama import LlamaConfig, LlamaForCausalLM, RotaryEmbedding

# Hugging Face architecture name -> family; both map onto graphattn's LlamaForCausalLM.
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_ROPE_TYPES = ("default", "linear", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
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
    """graphattn's ``LlamaForCausalLM`` with the weights of a Llama or Qwen2 checkpoint.

    ``source`` is a local folder (``config.json`` + safetensors) or a transformers
    ``LlamaForCausalLM`` / ``Qwen2ForCausalLM``. ``dtype`` defaults to the checkpoint's
    (the embedding's dtype); ``device`` to the CPU for a folder, the model's device for a
    model. Raises ``UnsupportedModelError`` for an architecture or config feature graphattn
    does not implement and ``WeightMismatchError`` naming every missing, unexpected or
    mis-shaped tensor.
    """
    wanted_dtype = parse_dtype(dtype, "dtype")  # the arguments first, before any file
    wanted_device = _device(device)
    checkpoint = _open_module(source) if isinstance(source, nn.Module) else _open_folder(source)
    cfg = config_from_hf(checkpoint.config, checkpoint.architecture)
    with torch.device("meta"):  # shapes only: nothing is allocated until the checks pass
        model = LlamaForCausalLM(cfg)
    slots = weight_slots(model, cfg)
    check_tensors(slots, checkpoint.shapes, cfg, checkpoint.architecture)
    target_dtype = wanted_dtype or checkpoint.dtype
    model = _materialize(model, cfg, target_dtype, wanted_device or checkpoint.device)
    _copy_weights(model, slots, checkpoint.tensors())
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


def config_from_hf(hf: dict[str, Any], architecture: str) -> LlamaConfig:
    """graphattn's ``LlamaConfig`` for a Hugging Face config dict (``config.json``).

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
    if family == "llama" and hf.get("attention_bias"):
        raise unsupported("attention_bias=True (q/k/v/o biases; expected False)")
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
    if kind not in _ROPE_TYPES:
        raise UnsupportedModelError(
            f"{architecture} with rope type {kind!r} is not supported (expected one of "
            f"{list(_ROPE_TYPES)}; rope settings {params})"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(
            f"{architecture} with partial_rotary_factor={params['partial_rotary_factor']} is "
            "not supported (expected 1.0)"
        )
    needed = {"default": (), "linear": ("factor",), "llama3": _LLAMA3_KEYS}[kind]
    absent = [key for key in needed if key not in params]
    if absent:
        raise ModelLoadError(f"{architecture} rope type {kind!r} needs {absent}; got {params}")
    if kind == "default":
        return theta, None
    return theta, {"rope_type": kind, **{key: params[key] for key in needed}}


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
    """Where one checkpoint tensor goes: rows ``start : start + shape[0]`` of ``param``."""

    param: str
    start: int
    shape: tuple[int, ...]


def weight_slots(model: LlamaForCausalLM, cfg: LlamaConfig) -> dict[str, _Slot]:
    """Hugging Face tensor name -> its slot in graphattn's model, for every tensor needed.

    A tied head shares the embedding's parameter, so it needs no tensor of its own.
    """
    d, hq, hk = cfg.head_size, cfg.num_attention_heads, cfg.kv_heads
    parts = {"qkv_proj": (hq * d, hk * d, hk * d), "gate_up_proj": (cfg.intermediate_size,) * 2}
    slots: dict[str, _Slot] = {}
    for name, param in model.named_parameters():  # a tied lm_head is listed once, as embed
        hf_name = name if name.startswith("lm_head.") else f"model.{name}"
        *_, module, leaf = hf_name.split(".")
        if module not in _MERGED:
            slots[hf_name] = _Slot(name, 0, tuple(param.shape))
            continue
        parent = hf_name.rsplit(".", 2)[0]
        start = 0
        for part, rows in zip(_MERGED[module], parts[module]):
            slots[f"{parent}.{part}.{leaf}"] = _Slot(name, start, (rows, *param.shape[1:]))
            start += rows
        assert start == param.shape[0], f"{name}: parts add up to {start} rows"
    return slots


def check_tensors(
    slots: dict[str, _Slot],
    shapes: dict[str, tuple[int, ...]],
    cfg: LlamaConfig,
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


def _describe(cfg: LlamaConfig, architecture: str) -> str:
    return (
        f"the checkpoint does not match the {architecture} its config describes "
        f"(hidden_size={cfg.hidden_size}, intermediate_size={cfg.intermediate_size}, "
        f"layers={cfg.num_hidden_layers}, heads={cfg.num_attention_heads}/{cfg.kv_heads} "
        f"of size {cfg.head_size}, vocab_size={cfg.vocab_size}):"
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
    model: LlamaForCausalLM, cfg: LlamaConfig, dtype: torch.dtype, device: torch.device
) -> LlamaForCausalLM:
    """Real (uninitialised) storage for the meta model; rotary caches computed again.

    Every parameter is overwritten by ``_copy_weights``; the rotary caches are buffers
    derived from the config, not checkpoint tensors. Their dtype follows the model's, as
    ``model.to(dtype)`` would leave it.
    """
    model = model.to(dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty may give the two names separate storage
        model.lm_head.weight = model.embed_tokens.weight
    rope = RotaryEmbedding(
        cfg.head_size, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
    )
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
            params[slot.param][slot.start : slot.start + slot.shape[0]].copy_(tensor)
