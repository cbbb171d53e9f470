"""graphattn: pluggable paged attention, piecewise torch.compile and CUDA graphs for LLM-style models.

engine = ga.compile(model, cudagraph_mode="FULL_AND_PIECEWISE", max_num_seqs=128)
out = engine.step(ga.Batch.from_requests([ga.Request([1, 2, 3], 0, [7])]))
"""

from graphattn import models
from graphattn.api import compile
from graphattn.attention import (
    Attention,
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MLAAttention,
    register_backend,
)
from graphattn.batch import Batch, Request
from graphattn.capture.mode import CUDAGraphMode
from graphattn.config import CompileConfig
from graphattn.engine import CompiledModel
from graphattn.errors import (
    BackendError,
    BackendSelectionError,
    CaptureError,
    ConfigError,
    CUDAGraphModeError,
    FallbackWarning,
    GraphAttnError,
    InvalidBatchError,
    InvalidInputError,
    OutOfBlocksError,
    RecompileError,
    UnsupportedModeError,
)
from graphattn.head import linear
from graphattn.report import EngineStats, Report
from graphattn.sampling import greedy

__version__ = "0.1.0"

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionCGSupport",
    "AttentionImpl",
    "AttentionMetadataBuilder",
    "BackendError",
    "BackendSelectionError",
    "Batch",
    "CUDAGraphMode",
    "CUDAGraphModeError",
    "CaptureError",
    "CommonAttentionMetadata",
    "CompileConfig",
    "CompiledModel",
    "ConfigError",
    "EngineStats",
    "FallbackWarning",
    "GraphAttnError",
    "InvalidBatchError",
    "InvalidInputError",
    "MLAAttention",
    "OutOfBlocksError",
    "RecompileError",
    "Report",
    "Request",
    "UnsupportedModeError",
    "compile",
    "greedy",
    "linear",
    "models",
    "register_backend",
]
