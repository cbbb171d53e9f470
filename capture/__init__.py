"""graphattn.capture: CUDA-graph modes, their negotiation with the backends, capture and replay."""

if __name__ != "graphattn.capture":
    raise ImportError(
        f"graphattn's capture package was imported as {__name__!r}; it only works as "
        "'graphattn.capture'. Install the checkout (pip install -e .) instead of putting "
        "the repository root on sys.path."
    )

from graphattn.capture.mode import CUDAGraphMode

__all__ = ["CUDAGraphMode"]
