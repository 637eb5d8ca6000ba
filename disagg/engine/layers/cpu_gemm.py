"""Linear algebra on CPU through oneDNN with the weight prepacked once, instead of F.linear (MKL).

MKL repacks the weight on every call, which at decode batch sizes costs more than the
multiplication itself; a copy packed once makes a decode step's GEMMs about twice as fast
(figures in loadtest/RESULTS.md).

The packed copy is made when the model loads, not on first use, so that a server's first
request does not pay for its pages faulting in. It is rebuilt when the weight changes (its version counter moves), costs one more copy of the weights in memory, and is
only used where it pays: CPU, float32, 2-D inputs. EngineConfig.cpu_gemm = "torch" (default:
DISAGG_CPU_GEMM) switches it off.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from disagg.config import CPU_GEMMS, set_env_default

logger = logging.getLogger(__name__)

GEMMS = CPU_GEMMS  # onednn, torch
# oneDNN builds kernels for each input shape (a step's row count is its token count) and keeps
# them in two caches of 1024 entries each, up to a megabyte an entry. Bounded here unless the
# environment sets them (to their defaults in disagg.config.ENV_VARS, 256): a worker then grows
# about half as much, at the same speed (loadtest/engine/onednn_cache.py, RESULTS.md).
CACHE_CAPACITY_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
# oneDNN picks the packed layout for this many rows; 32 measured best for both decode batches
# and 512-row prefill steps.
PACK_BATCH_HINT = 32


def onednn_enabled(gemm: str = "onednn") -> bool:
    """Whether GEMMs go through oneDNN: chosen (`gemm`, one of GEMMS) and available here."""
    if gemm not in GEMMS:
        raise ValueError(f"cpu gemm {gemm!r}: expected one of {', '.join(GEMMS)}")
    if gemm == "torch":
        return False
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def bound_onednn_caches() -> None:
    """Call before this process's first oneDNN operation: both caches read their size once."""
    for name in CACHE_CAPACITY_ENV:
        set_env_default(name)


class PackedWeight:
    """One weight's oneDNN-packed copy, made on first use and remade when the weight changes."""

    def __init__(self, gemm: str = "onednn") -> None:
        """`gemm`: one of GEMMS (EngineConfig.cpu_gemm)."""
        self.enabled = onednn_enabled(gemm)
        self._packed: torch.Tensor | None = None
        self._key: tuple[int, int] | None = None

    @property
    def is_packed(self) -> bool:
        return self._packed is not None

    def reset(self) -> None:
        self._packed, self._key = None, None

    def pack(self, weight: torch.Tensor) -> None:
        """Pack now (at load time) rather than on first use, where it applies."""
        self.reset()
        if self._applies(weight):
            self._packed_for(weight)

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, decode_rows: int | None = None
    ) -> torch.Tensor:
        """x @ weight.T + bias. `decode_rows` (the step's leading decode rows) matters only to a
        quantized weight in this one's place (layers/quantized.py): every row here is alike."""
        if not (self._applies(weight) and x.dim() == 2 and x.device.type == "cpu" and x.dtype == torch.float32):
            return F.linear(x, weight, bias)
        packed = self._packed_for(weight)
        if packed is None:
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")

    def _applies(self, weight: torch.Tensor) -> bool:
        return self.enabled and weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2

    def _packed_for(self, weight: torch.Tensor) -> torch.Tensor | None:
        key = (weight.data_ptr(), weight._version)
        if key != self._key:
            try:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
            except RuntimeError as exc:  # an unusual oneDNN build: stay on F.linear
                logger.warning("oneDNN weight packing failed, using F.linear: %s", exc)
                self.enabled = False
                self.reset()
                return None
            self._key = key
        return self._packed
