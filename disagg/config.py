"""Every setting, as frozen dataclasses validated in one place.

`EngineConfig` is what one engine instance (COLOCATED, PREFILL or DECODE) needs. The serving
config (pools, router, Redis) builds on it.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from dataclasses import dataclass, field
from pathlib import Path

from disagg.errors import InvalidRequestError

DEFAULT_MODEL = "smollm2-135m-instruct"
GiB = 1 << 30


class Role(str, enum.Enum):
    COLOCATED = "colocated"  # prefill and decode in one instance (chunked prefill)
    PREFILL = "prefill"  # runs prompts, samples the first token, keeps blocks for export
    DECODE = "decode"  # receives KV into pre-allocated blocks, then decodes

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor/pipeline parallel plan of one instance and this process's place in it."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            _require(getattr(self, name) >= 1, name, "must be >= 1")
        _require(0 <= self.tp_rank < self.tensor_parallel_size, "tp_rank", "out of range")
        _require(0 <= self.pp_rank < self.pipeline_parallel_size, "pp_rank", "out of range")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL  # GGUF file, HF directory, `random:<shape>` or the default's name
    tokenizer: str | None = None  # another model's tokenizer (e.g. for `random:` weights)
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    device: str = "auto"  # auto: cuda when available, else cpu
    role: Role = Role.COLOCATED
    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 1 * GiB
    max_num_batched_tokens: int = 512  # the per-step token budget (Sarathi-Serve)
    max_num_seqs: int = 128  # running requests at most
    max_waiting_requests: int = 4096  # bounded admission queue
    max_model_len: int | None = None  # defaults to the model's context length
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads; None: leave as is
    seed: int = 0
    cache_dir: str = field(default_factory=lambda: os.environ.get("DISAGG_CACHE_DIR", str(Path.home() / ".cache" / "disagg")))
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if isinstance(self.role, str) and not isinstance(self.role, Role):
            object.__setattr__(self, "role", _parse_enum(Role, self.role, "role"))
        _require(isinstance(self.model, str) and self.model.strip() != "", "model", "must be a non-empty string")
        _require(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype", "must be auto, float32, bfloat16 or float16")
        _require(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"), "device", "must be auto, cpu or cuda[:N]")
        _require(self.block_size >= 1 and (self.block_size & (self.block_size - 1)) == 0, "block_size", "must be a power of two")
        _require(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", "must be >= 1")
        _require(self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes", "must be > 0")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        _require(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _require(self.max_waiting_requests >= 1, "max_waiting_requests", "must be >= 1")
        _require(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "must be >= 2")
        _require(self.num_threads is None or self.num_threads >= 1, "num_threads", "must be >= 1")

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


def _parse_enum(enum_cls, value: str, field_name: str):
    try:
        return enum_cls(value.lower())
    except ValueError:
        choices = ", ".join(m.value for m in enum_cls)
        raise InvalidRequestError(field_name, f"must be one of {choices}, got {value!r}") from None


def _require(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(field_name, message)
