"""Every setting, as frozen dataclasses validated in one place, and every environment variable
the code reads (ENV_VARS, read through `env`).

`EngineConfig` is what one engine instance (COLOCATED, PREFILL or DECODE) needs. The serving
config (pools, router, Redis) builds on it. A setting's doc is the comment beside it or above
it: `disagg serve --help` and docs/settings.md show that text (disagg.settings).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import ipaddress
import os
import secrets
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field

from disagg.errors import InvalidRequestError
from disagg.slo import SLO

DEFAULT_MODEL = "smollm2-135m-instruct"
MiB = 1 << 20
GiB = 1 << 30
DEFAULT_KV_TIMEOUT_S = 30.0  # how long a KV transfer (or a prefill's wait for its targets) may take
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
DEFAULT_HEARTBEAT_TTL_S = 3.0
DEFAULT_DRAIN_TIMEOUT_S = 60.0  # ServingConfig.drain_timeout_s
DEFAULT_STEP_TIMEOUT_S = 120.0  # ServingConfig.step_timeout_s
DEFAULT_GROUP_TIMEOUT_S = 120.0  # ServingConfig.group_timeout_s
ATTENTION_BACKENDS = ("auto", "torch", "kernel")  # disagg.engine.layers.cpu_kernels.BACKENDS
CPU_GEMMS = ("onednn", "torch")  # disagg.engine.layers.cpu_gemm.GEMMS
WEIGHT_SETTINGS = ("auto", "fp32", "bf16", "int8", "int4", "fp8")  # EngineConfig.weights
# Where each quantized format has kernels: int8 and int4 on CPU (disagg/engine/layers/quantized.py),
# fp8 on CUDA (disagg/engine/layers/fp8.py); the other settings run anywhere.
WEIGHT_DEVICES = {"int8": "cpu", "int4": "cpu", "fp8": "cuda"}
PROMPT_PRECISIONS = ("fp32", "bf16")  # EngineConfig.prompt_precision
# How KV moves between instances (disagg.kv_transfer.factory): torch_dist is torch.distributed,
# gloo for CPU tensors and NCCL for CUDA ones.
KV_TRANSPORTS = ("torch_dist",)
DEFAULT_KV_TRANSPORT = "torch_dist"
# The waiting queue's order within a priority (disagg.engine.queue_order): fcfs, or ltr (shortest
# predicted output first, issue 39).
SCHEDULING_ORDERS = ("fcfs", "ltr")
DEFAULT_PRIORITY_AGING_S = 10.0
MIN_PLACEMENT_CANDIDATES = 8  # ServingConfig.placement_candidates: room for prefix holders, the least loaded and draws


# ---- the environment ---------------------------------------------------------------------------
@dataclass(frozen=True)
class EnvVar:
    """An environment variable the code reads: its name, its value when unset, what it does."""

    name: str
    default: str | None  # None: unset means "not given"
    doc: str


# Every environment variable read anywhere in disagg/, read through `env` (vLLM's envs.py holds
# its own likewise); docs/settings.md lists them. An empty value counts as unset.
API_KEY_ENV = "DISAGG_API_KEY"
ENV_VARS = (
    EnvVar(API_KEY_ENV, None, "the API key clients send; `disagg serve` takes it where the config sets no api_key"),
    EnvVar(
        "DISAGG_STATE_DIR",
        "~/.disagg",
        "where `disagg serve` records the deployment it runs (owner-only), for `disagg stop` and a second serve",
    ),
    EnvVar(
        "DISAGG_REDIS_URL",
        None,
        "the Redis `disagg serve` uses where the config sets no redis_url (deploy/head-serve.sh: the head's)",
    ),
    EnvVar("DISAGG_CACHE_DIR", "~/.cache/disagg", "engine.cache_dir's default: where converted weights are kept"),
    EnvVar("DISAGG_KV_SHARED_MEMORY", "1", "engine.kv_shared_memory's default; 0: off"),
    EnvVar("DISAGG_ATTENTION_BACKEND", "auto", "engine.attention_backend's default: auto, torch or kernel"),
    EnvVar("DISAGG_CPU_GEMM", "onednn", "engine.cpu_gemm's default: onednn or torch"),
    EnvVar("DISAGG_WEIGHTS", "auto", "engine.weights's default: auto, fp32, bf16, int8, int4 or fp8"),
    EnvVar("DISAGG_ENFORCE_EAGER", "0", "engine.enforce_eager's default; 1: on"),
    EnvVar(
        "DISAGG_KV_SEAL",
        "cross-host",
        "which KV pairs tag their gloo messages (disagg.kv_transfer.torch_dist): cross-host, or always",
    ),
    EnvVar("DISAGG_KERNEL_CACHE", None, "where the C++ CPU kernels are built; unset: $XDG_CACHE_HOME/disagg/kernels"),
    EnvVar("XDG_CACHE_HOME", None, "the user's cache directory (the kernels' default home); unset: ~/.cache"),
    EnvVar(
        "SSH_CONNECTION",
        None,
        "set by sshd: `python -m disagg.cluster.node_labels` finds the address a `ray up` node was reached at",
    ),
    EnvVar(
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY",
        "256",
        "oneDNN's kernel cache, in entries; an engine sets it to this unless the environment does (oneDNN: 1024)",
    ),
    EnvVar("LRU_CACHE_CAPACITY", "256", "ideep's kernel cache, in entries; set like ONEDNN_PRIMITIVE_CACHE_CAPACITY"),
    EnvVar(
        "TORCH_NCCL_BLOCKING_WAIT",
        "1",
        "NCCL KV pairs set it unless the environment does: a timed-out NCCL call raises instead of hanging",
    ),
)


def env(name: str) -> str | None:
    """Environment variable `name` (declared in ENV_VARS), or its default when unset or empty."""
    value = os.environ.get(name, "")
    return value if value.strip() else env_default(name)


def child_env(**updates: str) -> dict[str, str]:
    """This process's environment with `updates`: what a child process is started with."""
    return {**os.environ, **updates}


def set_env_default(name: str) -> None:
    """Set `name` (declared in ENV_VARS) to its default unless the environment sets it: for
    variables a library reads itself."""
    os.environ.setdefault(name, env_default(name))


def env_default(name: str) -> str | None:
    """What `env(name)` gives when the environment does not set it."""
    return _declared(name).default


def _declared(name: str) -> EnvVar:
    for var in ENV_VARS:
        if var.name == name:
            return var
    raise KeyError(f"environment variable {name} is not declared in disagg.config.ENV_VARS")


@dataclass(frozen=True)
class EnvDefault:
    """A setting's default taken from an environment variable when a config is made (docs show
    the variable, not this machine's value)."""

    name: str  # declared in ENV_VARS
    parse: Callable[[str], object]

    def __call__(self) -> object:
        return self.parse(env(self.name))


def _lowered(value: str) -> str:
    return value.strip().lower()


class Role(str, enum.Enum):
    COLOCATED = "colocated"  # prefill and decode in one instance (chunked prefill)
    PREFILL = "prefill"  # runs prompts, samples the first token, keeps blocks for export
    DECODE = "decode"  # receives KV into pre-allocated blocks, then decodes

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor/pipeline/expert parallel plan of one instance and this process's place in it."""

    tensor_parallel_size: int = 1  # workers the instance's layers are split across
    pipeline_parallel_size: int = 1  # the instance's pipeline stages
    tp_rank: int = 0  # this process's tensor-parallel rank
    pp_rank: int = 0  # this process's pipeline stage
    # A mixture of experts' experts split whole over a stage's tensor-parallel ranks, tokens sent
    # to them by all-to-all (vLLM's setting of that name; attention stays split by heads). Off:
    # each expert split by its intermediate size, as a dense MLP. A dense model ignores it.
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        _require_types(self)
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            _require(getattr(self, name) >= 1, name, "must be >= 1")
        _require(0 <= self.tp_rank < self.tensor_parallel_size, "tp_rank", "out of range")
        _require(0 <= self.pp_rank < self.pipeline_parallel_size, "pp_rank", "out of range")
        _require(isinstance(self.enable_expert_parallel, bool), "enable_expert_parallel", "must be true or false")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def expert_parallel_size(self) -> int:
        """The ranks a mixture of experts' experts are split over (1: every rank holds every expert)."""
        return self.tensor_parallel_size if self.enable_expert_parallel else 1


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL  # GGUF file, HF directory, `random:<shape>` or the default's name
    tokenizer: str | None = None  # another model's tokenizer (e.g. for `random:` weights)
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    device: str = "auto"  # auto: cuda when available, else cpu
    role: Role = Role.COLOCATED  # what this engine runs (a serving config's pools set it)
    block_size: int = 16  # tokens per KV cache block (a power of two)
    num_kv_blocks: int | None = None  # KV cache blocks per worker; overrides kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 1 * GiB  # the KV cache's size per worker, unless num_kv_blocks is set
    # The fraction of its GPU's memory this worker may take (weights, KV cache, activations), as
    # vLLM's setting of that name: at start, what it needs must fit in this share of the GPU's
    # memory, and in what the GPU has free (disagg/engine/memory_fit.py), or it is refused.
    # None: its pool's num_gpus_per_worker where that is below 1 (workers sharing a GPU), else
    # whatever the GPU has free. On a CPU the host's available memory is the bound.
    gpu_memory_utilization: float | None = None
    max_num_batched_tokens: int = 512  # the per-step token budget (Sarathi-Serve)
    # Fair prefill (vLLM's setting of that name): a prompt's chunk is first capped at this many
    # tokens a step, until every prompt waiting for a chunk has had its share; the rest of the
    # budget then goes to the prompts it finishes, and in a step that finishes none, to the
    # others (disagg/engine/scheduler.py). So short prompts behind a long
    # one get their first token in a step or two, not after it. None: a quarter of
    # max_num_batched_tokens; 0: off (first come takes the whole budget). (disagg/engine/scheduler.py)
    long_prefill_token_threshold: int | None = None
    # Fair prefill's caps count a chunk's attention work, not only its tokens: a step deep in a
    # long prompt carries fewer tokens and stays as short as its first, so a prompt that comes
    # meanwhile waits no longer for it; the long prompt itself takes longer (more, smaller steps:
    # about a quarter longer for 8,000 tokens on 2 CPU cores, loadtest/RESULTS.md). False: tokens only.
    long_prefill_by_work: bool = True
    scheduling_policy: str = "chunked"  # or "prefill_first" (whole prompts first, decodes stall: vLLM v0)
    # Requests are served by priority (critical, standard, sheddable; vLLM's integers, lower
    # first) in the queue, the batch and preemption, then by `scheduling_order` (SCHEDULING_ORDERS).
    # A waiting request rises one priority per `priority_aging_s` waited, so none waits without
    # bound (disagg/engine/queue_order.py).
    scheduling_order: str = "fcfs"
    # Under ltr, the ranker file that predicts each request's output length when it is added
    # (disagg.ranking); None: the one bundled for the default model. Not read under fcfs.
    length_ranker: str | None = None
    priority_aging_s: float = DEFAULT_PRIORITY_AGING_S  # a waiting request rises one priority per this many seconds
    max_num_seqs: int = 128  # requests running at once (the batch), at most
    max_waiting_requests: int = 4096  # requests waiting in an engine's queue, at most (more are refused)
    max_model_len: int | None = None  # prompt plus output tokens at most; None: the model's context length
    enable_prefix_caching: bool = True  # reuse the KV of a prompt's cached prefix blocks
    # KV tiers under the pool (disagg/engine/kv_tiers/): a block the prefix cache evicts goes down
    # to a host-memory store of at most this many bytes (LRU) instead of being lost, and a prompt
    # whose prefix is there has it copied back instead of recomputed. 0: no host tier. Not on
    # models with a sliding window, nor on an instance of several workers (yet).
    kv_host_tier_bytes: int = 256 * MiB
    # Under the host tier: a directory (emptied at start) holding at most kv_disk_tier_bytes of
    # the blocks the host tier drops. None: no disk tier.
    kv_disk_tier_dir: str | None = None
    kv_disk_tier_bytes: int = 4 * GiB  # the disk tier's size in bytes, when kv_disk_tier_dir is set
    # Cluster-wide prefix index: block events (stored in a tier, dropped) wait for the worker's
    # publisher in a queue of at most this many; past it the oldest are lost and the whole
    # index is republished. 0: no index events (the router keeps the heartbeat's summary).
    kv_index_max_events: int = 65536
    num_threads: int | None = None  # torch intra-op threads; None: leave as is
    seed: int = 0  # the random seed of sampling and of `random:` weights
    # Where converted weights are kept.
    cache_dir: str = field(default_factory=EnvDefault("DISAGG_CACHE_DIR", os.path.expanduser))
    # This rank's place in its instance (a serving config's pools set it).
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # A prefill cache in shared memory, so that a decode worker on this host copies the KV
    # straight out of it; off: KV always goes over the transport.
    kv_shared_memory: bool = field(default_factory=EnvDefault("DISAGG_KV_SHARED_MEMORY", lambda v: v != "0"))
    # The C++ CPU kernels (decode attention, norm, rotary, the transfer's block copy): auto (where
    # they build), torch (never), kernel (always, or an error).
    attention_backend: str = field(default_factory=EnvDefault("DISAGG_ATTENTION_BACKEND", _lowered))
    # GEMMs on CPU: onednn (prepacked weights) or torch (F.linear).
    cpu_gemm: str = field(default_factory=EnvDefault("DISAGG_CPU_GEMM", _lowered))
    # How weights are kept: auto (a GGUF's 4-bit blocks as int4, its other quantized ones as int8,
    # on CPU; float checkpoints dense), fp32 or bf16 (dense; the dtype unless `dtype` sets one), int8 or int4 (quantized at
    # load, CPU: disagg/engine/layers/quantized.py), fp8 (quantized at load, per-channel scales,
    # CUDA with FP8 tensor cores: Hopper, Ada; disagg/engine/layers/fp8.py).
    weights: str = field(default_factory=EnvDefault("DISAGG_WEIGHTS", _lowered))
    # Quantized weights: what prompts multiply in (a decode's row takes the 4/8-bit kernel). fp32: a prompt's
    # first token is the reference's (transformers on the dequantized weights) even at a near-tie;
    # bf16: 1.4-1.7x faster prompts, llama.cpp-like numbers; a decode instance too (the prompts
    # it recomputes then match a prefill instance's). (disagg/engine/layers/quantized.py)
    prompt_precision: str = "fp32"
    # Structured output: tokens a request's grammar forces are appended without sampling them
    # (SGLang's jump-forward); off: each is decoded in a step of its own.
    jump_forward: bool = True
    # Outputs that do not depend on how a prompt was computed: with quantized weights, every row
    # (prompt rows too) takes the quantized kernel, row by row, where by default a prompt's rows
    # take a float copy, faster and not bit-equal to a decode's (layers/quantized.py; either way
    # no row's numbers depend on how many others its step holds). Every row's attention, a
    # prompt's too, goes through the decode kernel over the paged cache, so a prompt in chunks
    # or whole, or recomputed with the tokens it generated (a migration), gives the same numbers.
    # Slower prompts, and a prompt's first token as llama.cpp computes it (int8 activations),
    # not as transformers does.
    batch_invariant: bool = False
    # On CUDA, decode-only steps replay CUDA graphs captured at start (disagg/engine/cuda_graphs.py);
    # True: every step runs eagerly, as vLLM's setting of the same name. CPU always runs eagerly.
    enforce_eager: bool = field(default_factory=EnvDefault("DISAGG_ENFORCE_EAGER", lambda v: v == "1"))
    # On CPU, a decode-only step runs each Llama-family decoder layer as one C++ call (norms, QKV,
    # rotary, KV write, attention, o_proj, MLP: disagg/engine/layers/decode_layer.py) where its
    # weights take the 4/8-bit kernels, with the same numbers as the layer's op-by-op path; off:
    # op by op.
    fused_layer: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.role, str) and not isinstance(self.role, Role):
            object.__setattr__(self, "role", _parse_enum(Role, self.role, "role"))
        _require_types(self)
        _require(self.model.strip() != "", "model", "must be a non-empty string")
        _require(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            "dtype",
            "must be auto, float32, bfloat16 or float16",
        )
        _require(
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
            "device",
            "must be auto, cpu or cuda[:N]",
        )
        _require(
            self.block_size >= 1 and (self.block_size & (self.block_size - 1)) == 0,
            "block_size",
            "must be a power of two",
        )
        _require(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", "must be >= 1")
        _require(self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes", "must be > 0")
        _require(self.kv_host_tier_bytes >= 0, "kv_host_tier_bytes", "must be >= 0 (0: no host tier)")
        _require(self.kv_disk_tier_bytes >= 0, "kv_disk_tier_bytes", "must be >= 0")
        _require(
            self.kv_disk_tier_dir is None or self.kv_disk_tier_dir.strip() != "",
            "kv_disk_tier_dir",
            "must be a directory path or null (no disk tier)",
        )
        _require(self.kv_index_max_events >= 0, "kv_index_max_events", "must be >= 0 (0: no index events)")
        _require(
            self.gpu_memory_utilization is None
            or (
                isinstance(self.gpu_memory_utilization, (int, float))
                and not isinstance(self.gpu_memory_utilization, bool)
                and 0 < self.gpu_memory_utilization <= 1
            ),
            "gpu_memory_utilization",
            f"must be a fraction in (0, 1] of the GPU's memory, got {self.gpu_memory_utilization!r}",
        )
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        _require(
            self.long_prefill_token_threshold is None
            or (
                isinstance(self.long_prefill_token_threshold, int)
                and not isinstance(self.long_prefill_token_threshold, bool)
                and self.long_prefill_token_threshold >= 0
            ),
            "long_prefill_token_threshold",
            f"must be a number of tokens >= 0 (0: no cap), got {self.long_prefill_token_threshold!r}",
        )
        _require(isinstance(self.long_prefill_by_work, bool), "long_prefill_by_work", "must be true or false")
        _require(
            self.scheduling_policy in ("chunked", "prefill_first"),
            "scheduling_policy",
            "must be chunked or prefill_first",
        )
        _require(
            self.scheduling_order in SCHEDULING_ORDERS,
            "scheduling_order",
            f"must be one of {', '.join(SCHEDULING_ORDERS)}, got {self.scheduling_order!r}",
        )
        _require(
            self.length_ranker is None or (isinstance(self.length_ranker, str) and self.length_ranker.strip() != ""),
            "length_ranker",
            f"must be the path of a ranker file (disagg.ranking), got {self.length_ranker!r}",
        )
        _require(
            self.length_ranker is None or self.scheduling_order == "ltr",
            "length_ranker",
            "is used only with scheduling_order ltr (fcfs predicts no lengths)",
        )
        _require(
            isinstance(self.priority_aging_s, (int, float))
            and not isinstance(self.priority_aging_s, bool)
            and self.priority_aging_s > 0,
            "priority_aging_s",
            f"must be a number of seconds > 0 (a waiting request rises one priority per as many), "
            f"got {self.priority_aging_s!r}",
        )
        _require(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _require(self.weights in WEIGHT_SETTINGS, "weights", f"must be one of {', '.join(WEIGHT_SETTINGS)}")
        if self.device != "auto":  # else the engine checks the device it resolves
            require_weights_on(self.weights, self.device.partition(":")[0])
        _require(
            self.prompt_precision in PROMPT_PRECISIONS,
            "prompt_precision",
            f"must be one of {', '.join(PROMPT_PRECISIONS)}",
        )

        _require(self.max_waiting_requests >= 1, "max_waiting_requests", "must be >= 1")
        _require(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "must be >= 2")
        _require(self.num_threads is None or self.num_threads >= 1, "num_threads", "must be >= 1")
        _require(
            self.attention_backend in ATTENTION_BACKENDS,
            "attention_backend",
            f"must be one of {', '.join(ATTENTION_BACKENDS)} (DISAGG_ATTENTION_BACKEND)",
        )
        _require(self.cpu_gemm in CPU_GEMMS, "cpu_gemm", f"must be one of {', '.join(CPU_GEMMS)} (DISAGG_CPU_GEMM)")

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    @property
    def prefill_chunk_cap(self) -> int:
        """A prompt chunk's first share of a step, as its scheduler takes it (the router predicts with it)."""
        if self.scheduling_policy == "prefill_first":
            return self.max_num_batched_tokens  # whole prompts: nothing is capped
        return prefill_chunk_cap(self.max_num_batched_tokens, self.long_prefill_token_threshold)


def prefill_chunk_cap(budget: int, long_prefill_token_threshold: int | None) -> int:
    """Fair prefill's cap on a prompt chunk's first share of a step of `budget` tokens: the
    threshold, by default (None) a quarter of the budget; the budget itself when it is 0 (off)."""
    if long_prefill_token_threshold is None:
        return max(1, budget // 4)
    return min(long_prefill_token_threshold, budget) if long_prefill_token_threshold > 0 else budget


def _parse_enum(enum_cls, value: str, field_name: str):
    try:
        return enum_cls(value.lower())
    except ValueError:
        choices = ", ".join(m.value for m in enum_cls)
        raise InvalidRequestError(field_name, f"must be one of {choices}, got {value!r}") from None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return False


def _require_types(config) -> None:
    """Each field of `config` holds its declared type: a YAML file or a flag may give anything."""
    hints = field_types(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        _require(_is_of(value, hints[f.name]), f.name, f"must be {type_name(hints[f.name])}, got {value!r}")


@functools.cache
def field_types(cls: type) -> dict:
    """{field name: declared type} of config dataclass `cls`."""
    return typing.get_type_hints(cls)


def _is_of(value, hint) -> bool:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_is_of(value, arm) for arm in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, typing.get_origin(hint) or hint)


def type_name(hint) -> str:
    """A declared type as a message names it: "an integer", "a number or null", ..."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(type_name(arm) for arm in typing.get_args(hint))
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a mapping"}
    names |= {list: "a list", type(None): "null"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def require_weights_on(weights: str, device_type: str) -> None:
    """InvalidRequestError (a ValueError) where `weights` (EngineConfig.weights) has no kernel on
    `device_type` (cpu, cuda)."""
    home = WEIGHT_DEVICES.get(weights)
    if home is None or home == device_type:
        return
    if home == "cpu":
        advice = "use weights: fp8 (Hopper or Ada), bf16 or auto on a GPU"
    else:
        advice = "use weights: int8, int4 or auto on a CPU"
    raise InvalidRequestError(
        "weights", f"{weights} runs on {home} only (no {device_type} kernel for it yet): {advice}"
    )


def _require(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(field_name, message)


def _require_kv_transport(name: str) -> None:
    _require(name in KV_TRANSPORTS, "kv_transport", f"must be one of {', '.join(KV_TRANSPORTS)}, got {name!r}")


@dataclass(frozen=True)
class WorkerConfig:
    """What one worker process (any rank of an instance, any role) is started with."""

    instance_id: str
    role: Role  # COLOCATED, PREFILL or DECODE
    engine: EngineConfig  # this rank's (its `parallel` says which rank it is)
    registry_url: str | None = None  # None: no heartbeats (tests)
    host: str | None = "127.0.0.1"  # what it listens on and advertises; None: this node's IP (disagg.hosts.addressing)
    kv_timeout_s: float = DEFAULT_KV_TIMEOUT_S
    kv_transport: str = DEFAULT_KV_TRANSPORT
    num_threads: int = 1  # torch intra-op threads
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    heartbeat_ttl_s: float = DEFAULT_HEARTBEAT_TTL_S
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S  # ServingConfig.drain_timeout_s
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S  # ServingConfig.step_timeout_s
    group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S  # ServingConfig.group_timeout_s
    actor_name: str = ""
    engine_cpus: tuple[int, ...] | None = (
        None  # where the engine thread runs (disagg.hosts.cpu_binding); None: where the process may
    )
    relaunched: bool = False  # the launcher brings it back should it leave service (routers wait for it)
    # The deployment's key (disagg.auth): routers and KV peers must prove they hold it. Ray carries
    # it in the actor's arguments; it is never on a command line, in Redis, or in a repr.
    link_key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.role, str) and not isinstance(self.role, Role):
            object.__setattr__(self, "role", _parse_enum(Role, self.role, "role"))
        _require(
            isinstance(self.instance_id, str) and self.instance_id != "", "instance_id", "must be a non-empty string"
        )
        for name in ("kv_timeout_s", "drain_timeout_s", "step_timeout_s", "group_timeout_s"):
            _require(getattr(self, name) > 0, name, "must be > 0")
        _require_kv_transport(self.kv_transport)
        _require(isinstance(self.link_key, bytes) and len(self.link_key) >= 16, "link_key", "must be >= 16 bytes")
        _require(self.num_threads >= 1, "num_threads", "must be >= 1")
        _require(
            self.heartbeat_ttl_s > self.heartbeat_interval_s > 0,
            "heartbeat_ttl_s",
            "must exceed heartbeat_interval_s (> 0)",
        )

    def replace(self, **changes) -> "WorkerConfig":
        return dataclasses.replace(self, **changes)


# ---- the service ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolConfig:
    """One pool of instances (prefill, decode or colocated) and where its workers run."""

    num_instances: int = 1  # instances in the pool
    tensor_parallel_size: int = 1  # workers an instance's layers are split across (TP)
    pipeline_parallel_size: int = 1  # pipeline stages of an instance (PP); workers per instance: TP x PP
    enable_expert_parallel: bool = False  # experts split whole over the TP ranks (ParallelConfig's)
    num_cpus_per_worker: float = 1.0  # the CPUs Ray reserves for each worker
    num_gpus_per_worker: float = 0.0  # the GPUs Ray reserves for each worker (a fraction shares one)
    resources: dict = field(default_factory=dict, hash=False)  # extra Ray resources per worker, e.g. {"prefill": 1}
    engine: dict = field(default_factory=dict, hash=False)  # EngineConfig fields that differ for this pool
    # Per instance, in order: what differs for that one instance, `threads_per_worker` and/or
    # `engine` (EngineConfig fields), e.g. two prefill instances on unequal hardware.
    instances: list = field(default_factory=list, hash=False)

    def __post_init__(self) -> None:
        _require_types(self)
        _require(self.num_instances >= 0, "num_instances", "must be >= 0")
        _require(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")
        _require(self.pipeline_parallel_size >= 1, "pipeline_parallel_size", "must be >= 1")
        _require(self.num_cpus_per_worker >= 0 and self.num_gpus_per_worker >= 0, "num_cpus_per_worker", "must be >= 0")
        unknown = set(self.engine) - {f.name for f in dataclasses.fields(EngineConfig)}
        _require(not unknown, "engine", f"unknown engine settings {sorted(unknown)}")
        _require(len(self.instances) <= self.num_instances, "instances", "has more entries than num_instances")
        for index, override in enumerate(self.instances):
            _require(isinstance(override, dict), "instances", f"entry {index} must be a mapping")
            unknown = set(override) - INSTANCE_OVERRIDES
            _require(not unknown, "instances", f"entry {index}: unknown settings {sorted(unknown)}, "
                     f"known: {sorted(INSTANCE_OVERRIDES)}")  # fmt: skip
            threads = override.get("threads_per_worker", 1)
            _require(
                isinstance(threads, int) and threads >= 1,
                "instances",
                f"entry {index}: threads_per_worker must be >= 1",
            )
            unknown = set(override.get("engine") or {}) - {f.name for f in dataclasses.fields(EngineConfig)}
            _require(not unknown, "instances", f"entry {index}: unknown engine settings {sorted(unknown)}")

    def instance_override(self, index: int) -> dict:
        return self.instances[index] if index < len(self.instances) else {}

    @property
    def workers_per_instance(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


INSTANCE_OVERRIDES = {"threads_per_worker", "engine"}


# What each worker takes of its node's pool label (a custom Ray resource named after the pool):
# a sliver, so that a labelled node holds any number of workers.
POOL_LABEL_SLIVER = 0.001

MODES = ("disaggregated", "colocated")
PLACEMENTS = ("goodput", "least_work")
SLO_ADMISSIONS = ("reject", "best_effort")
OUTPUT_LENGTHS = ("max_tokens", "ranker")  # ServingConfig.output_length (disagg.router.output_lengths)
CPU_BINDINGS = ("auto", "on", "off")


@dataclass(frozen=True)
class ServingConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)  # model and engine settings shared by every pool
    mode: str = "disaggregated"  # disaggregated: a prefill and a decode pool; colocated: one pool doing both
    prefill: PoolConfig = field(default_factory=PoolConfig)  # the prefill pool (disaggregated mode)
    decode: PoolConfig = field(default_factory=PoolConfig)  # the decode pool (disaggregated mode)
    colocated: PoolConfig = field(default_factory=PoolConfig)  # the one pool of colocated mode
    host: str = "127.0.0.1"  # where the gRPC frontend listens
    port: int = 50051  # the gRPC frontend's port; 0: any free port
    http_host: str = "127.0.0.1"  # where the OpenAI-compatible HTTP API listens (disagg.router.http_frontend)
    http_port: int = 8000  # the OpenAI-compatible HTTP API's port; 0: no HTTP API
    # Where workers listen (request link, KV); None: loopback on one node, each node's IP on several.
    worker_host: str | None = None
    metrics_port: int | None = None  # the port of Prometheus /metrics; None: off
    redis_url: str | None = None  # the Redis holding the cluster's metadata; None: start a local redis-server
    ray_address: str | None = None  # the Ray cluster to join ("auto": the one on this node); None: start a local Ray
    slo: SLO = field(default_factory=SLO)  # every request's targets unless it sets its own
    placement: str = "goodput"  # goodput: by predicted TTFT/TPOT against the SLO; least_work (disagg.placement)
    slo_admission: str = "reject"  # a request no instance is predicted to serve in time: reject | best_effort
    # What the router expects a request to write, for its TPOT prediction: max_tokens, or the
    # output-length ranker's prediction (disagg.router.output_lengths).
    output_length: str = "max_tokens"
    profile: str | None = None  # a profile file (`disagg profile`) seeding each instance's latency model
    # Without a profile, goodput placement measures each instance's model at start, for at most
    # this long (disagg.router.calibration); 0: off, instances calibrate on traffic.
    calibration_s: float = 30.0
    # Conditional disaggregation (goodput placement): a prompt with at most this many uncached
    # tokens may be prefilled by its decode instance when predicted faster; 0: always disaggregate.
    local_prefill_max_tokens: int = 0
    # Decode-side reuse (goodput placement): a decode instance holding a longer prefix of the
    # prompt than any prefill instance (a conversation's history: its last answer is only there)
    # may prefill at most this many uncached tokens itself when predicted faster; 0: never.
    decode_reuse_max_tokens: int = 512
    # Peer block fetch (disagg.router.peer_fetch): a prefill instance that lacks a prompt's
    # cached prefix fetches the blocks from the instance the prefix index says holds more (a
    # decode instance with the conversation's history, another prefill instance), when moving
    # them at peer_fetch_gb_s plus peer_fetch_latency_ms is predicted faster than computing them.
    peer_fetch: bool = True
    peer_fetch_gb_s: float = 1.0  # a conservative rate for the KV transport between two instances
    peer_fetch_latency_ms: float = 5.0  # the three calls that set a fetch up, and the transfer's own latency
    peer_fetch_timeout_s: float = 2.0  # a fetch not done by then is given up: the prefill computes the blocks
    # Goodput placement predicts at most this many instances of a pool (its prompt's prefix
    # holders, the least loaded, a few at random; disagg.placement.narrowing); 0: every instance.
    placement_candidates: int = 12
    # Requests in flight at most, more are refused RESOURCE_EXHAUSTED; None: as many as the decode
    # (or colocated) pool runs at once (ServingConfig.inflight_limit).
    max_inflight_requests: int | None = None
    # Frontends serving the same instances: this process's, and frontends - 1 more as Ray actors
    # (disagg.server.FrontendReplica), frontend i on port + i and http_port + i (an ephemeral
    # port where those are 0). Each admits its share of the in-flight bound.
    frontends: int = 1
    # How long a request may wait for room on a decode instance (at most kv_timeout_s: the prefill
    # instance holds its computed prompt that long).
    admission_timeout_s: float = 30.0
    request_timeout_s: float = 600.0  # a request's deadline from its arrival, unless the client sets a shorter one
    max_migrations: int = 3  # times a request may move on after an instance failed under it (disagg.router.migration)
    recovery_timeout_s: float = 60.0  # how long a migrating request waits for a healthy instance (a relaunch)
    max_worker_restarts: int = -1  # a dead instance is relaunched this often (per instance); -1: always, 0: never
    kv_timeout_s: float = DEFAULT_KV_TIMEOUT_S  # how long a KV transfer (or a prefill's wait for its targets) may take
    kv_transport: str = DEFAULT_KV_TRANSPORT  # how prefill instances send KV to decode ones (KV_TRANSPORTS)
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S  # how often a worker refreshes its entry in Redis
    # A worker whose entry was not refreshed for this long is taken out of placement (its Redis key expires).
    heartbeat_ttl_s: float = DEFAULT_HEARTBEAT_TTL_S
    # How long `disagg serve` waits for its workers to load their model and start (a relaunched
    # instance too), and for the frontends to start.
    start_timeout_s: float = 600.0
    warm_up_timeout_s: float = 120.0  # each warm-up request's limit (warm_up); one that times out is logged, not fatal
    drain_grace_s: float = 10.0  # on SIGINT/SIGTERM, how long in-flight requests get to finish before the server stops
    # After SIGTERM (or a scale-in), how long a decode instance waits for routers to move its
    # requests away with their KV before it exits (what is left then migrates by recompute).
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    # A TP x PP instance: one step's limit across its ranks (a rank that hangs fails the step after
    # this long, instead of stalling the instance); the first step may be slow.
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S
    # A TP x PP instance's torch.distributed groups: how long its ranks may take to join them, and
    # each gloo collective (a peer that died mid-step fails it after this long).
    group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S
    # Every Ray call and request-link call a control loop awaits (re-planning, rebalancing, drains,
    # health, relaunch supervision) fails after this long: a wedged instance cannot stop a loop.
    control_call_timeout_s: float = 10.0
    # Health (gRPC and HTTP /health) turns NOT_SERVING once the deployment's controller has been
    # gone this long (its heartbeat key lapsed): long enough for Ray to restart a killed one.
    controller_grace_s: float = 15.0
    threads_per_worker: int = 1  # torch intra-op threads of each worker (a pool's instances entry may differ)
    cpu_binding: str = "auto"  # on a machine whose Ray we start, engine threads get CPUs of their own; auto: only where 2 stay for the rest, on: 1 (disagg.hosts.cpu_binding)
    warm_up: bool = True  # one request through every instance before serving (disagg.router.warm_up)
    # The closed loop (disagg.router.replanning): instances switch between prefill and decode
    # as the traffic shifts. Every replan_interval_s, the last replan_window_s of arrivals are
    # replayed by the simulator on each split; at most one switch per replan_hold_s.
    replan: bool = True
    replan_interval_s: float = 5.0  # how often the re-planner considers a switch
    # How much recent traffic the re-planner replays: with the live state priced (issue 53) it is only the
    # forecast of arrivals, and a short one follows a shift sooner (the simulator's shifting trace: 1.04x the
    # best static split at 15 s, 0.90x at 30 s).
    replan_window_s: float = 15.0
    replan_hold_s: float = 20.0  # at most one switch per this many seconds
    replan_switch_timeout_s: float = 30.0  # how long a switching instance may take to finish its requests
    replan_min_gain: float = 5.0  # points of predicted SLO attainment a switch must gain
    replan_price_timeout_s: float = 30.0  # how long one round's simulations may take (their process is ended after)
    replan_undo_margin: float = 5.0  # points of attainment a switch may measure under staying before it is undone
    # Scaling (issue 53): where the cluster has room for a whole instance of a pool's shape, the loop
    # prices one more instance in each pool (and one fewer where the window's load fits in fewer) as it
    # prices switches, and adds or removes one when that beats staying by replan_min_gain.
    replan_scale: bool = True
    replan_max_instances: int = 4  # instances of one pool at most, by scaling (never fewer than one)
    replan_max_total_instances: int = 0  # instances of both pools together at most (0: only the per-pool bound)
    replan_pd_ratio: float = 0.0  # prefill instances per decode instance that scaling keeps within one of (0: none)
    api_key: str | None = None  # if set, clients send it as `x-api-key` metadata (HTTP: `Authorization: Bearer`)
    tls_cert_file: str | None = None  # TLS on the gRPC and the HTTP port alike
    tls_key_file: str | None = None  # the private key of tls_cert_file
    # A CA (PEM): clients must present a certificate it signed (gRPC, HTTP, /metrics); needs tls_cert_file.
    tls_client_ca_file: str | None = None
    # With api_key set, gRPC health and reflection, HTTP /health and /metrics ask for it too;
    # true leaves the two health checks open (a load balancer's probe sends no key).
    health_without_key: bool = False
    # Listening on an address other than loopback with neither api_key nor client certificates
    # (tls_client_ca_file) is refused unless this says so: anyone who reaches the port could use
    # the model (TLS alone encrypts, but authenticates no client).
    insecure: bool = False

    def __post_init__(self) -> None:
        _require_types(self)
        _require(self.mode in MODES, "mode", f"must be one of {', '.join(MODES)}, got {self.mode!r}")
        _require(self.placement in PLACEMENTS, "placement", f"must be one of {', '.join(PLACEMENTS)}")
        _require(self.local_prefill_max_tokens >= 0, "local_prefill_max_tokens", "must be >= 0")
        _require(self.decode_reuse_max_tokens >= 0, "decode_reuse_max_tokens", "must be >= 0")
        _require(self.peer_fetch_gb_s > 0, "peer_fetch_gb_s", "must be > 0")
        _require(self.peer_fetch_latency_ms >= 0, "peer_fetch_latency_ms", "must be >= 0")
        _require(
            self.placement_candidates == 0 or self.placement_candidates >= MIN_PLACEMENT_CANDIDATES,
            "placement_candidates",
            f"must be 0 (every instance) or >= {MIN_PLACEMENT_CANDIDATES}",
        )
        _require(self.calibration_s >= 0, "calibration_s", "must be >= 0 (0: off)")
        _require(self.slo_admission in SLO_ADMISSIONS, "slo_admission", f"must be one of {', '.join(SLO_ADMISSIONS)}")
        _require(self.output_length in OUTPUT_LENGTHS, "output_length", f"must be one of {', '.join(OUTPUT_LENGTHS)}")
        _require_kv_transport(self.kv_transport)
        _require(
            self.cpu_binding in CPU_BINDINGS,
            "cpu_binding",
            f"must be one of {', '.join(CPU_BINDINGS)}, got {self.cpu_binding!r}",
        )
        _require(0 <= self.port < 65536, "port", "must be in [0, 65535]")
        _require(0 <= self.http_port < 65536, "http_port", "must be in [0, 65535] (0: no HTTP API)")
        _require(isinstance(self.http_host, str) and self.http_host != "", "http_host", "must be a non-empty string")
        _require(
            self.worker_host is None or self.worker_host not in ("0.0.0.0", "::", ""),
            "worker_host",
            "must be an address peers can connect to, not a wildcard",
        )
        _require(
            self.max_inflight_requests is None or self.max_inflight_requests >= 1,
            "max_inflight_requests",
            "must be >= 1",
        )
        _require(self.max_migrations >= 0, "max_migrations", "must be >= 0")
        _require(
            isinstance(self.frontends, int) and not isinstance(self.frontends, bool) and self.frontends >= 1,
            "frontends",
            "must be an integer >= 1",
        )
        _require(self.max_worker_restarts >= -1, "max_worker_restarts", "must be >= -1 (-1: always)")
        for name in (
            "admission_timeout_s",
            "recovery_timeout_s",
            "request_timeout_s",
            "kv_timeout_s",
            "heartbeat_interval_s",
            "heartbeat_ttl_s",
            "start_timeout_s",
            "warm_up_timeout_s",
            "drain_grace_s",
            "drain_timeout_s",
            "step_timeout_s",
            "group_timeout_s",
            "replan_interval_s",
            "replan_window_s",
            "replan_switch_timeout_s",
            "replan_price_timeout_s",
            "control_call_timeout_s",
            "peer_fetch_timeout_s",
        ):
            _require(getattr(self, name) > 0, name, "must be > 0")
        _require(self.replan_undo_margin >= 0, "replan_undo_margin", "must be >= 0")
        for name in ("replan_max_instances", "replan_max_total_instances", "replan_pd_ratio"):
            _require(getattr(self, name) >= 0, name, "must be >= 0")
        _require(self.controller_grace_s >= 0, "controller_grace_s", "must be >= 0")
        _require(
            self.heartbeat_ttl_s > self.heartbeat_interval_s, "heartbeat_ttl_s", "must exceed heartbeat_interval_s"
        )
        _require(
            (self.tls_cert_file is None) == (self.tls_key_file is None),
            "tls_cert_file",
            "give both tls_cert_file and tls_key_file, or neither",
        )
        _require(
            self.tls_client_ca_file is None or self.tls_cert_file is not None,
            "tls_client_ca_file",
            "client certificates need TLS: give tls_cert_file and tls_key_file too",
        )
        self._require_guarded_listeners()
        pools = (self.prefill, self.decode) if self.mode == "disaggregated" else (self.colocated,)
        _require(
            all(p.num_instances >= 1 for p in pools),
            "num_instances",
            f"{self.mode} mode needs at least one instance per pool",
        )

    def _require_guarded_listeners(self) -> None:
        """Our listeners for clients (gRPC, HTTP, /metrics) off loopback need a key or client
        certificates: something that tells who the client is. TLS alone does not."""
        listeners = [("host", self.host)] + ([("http_host", self.http_host)] if self.http_port else [])
        open_ones = [(name, host) for name, host in listeners if not _is_loopback(host)]
        if not open_ones or self.api_key or self.tls_client_ca_file or self.insecure:
            return
        name, host = open_ones[0]
        tls = "with TLS but " if self.tls_cert_file else ""
        raise InvalidRequestError(
            name,
            f"listening on {host} {tls}with neither api_key nor client certificates lets anyone who reaches "
            "the port use the model; set api_key (or $DISAGG_API_KEY), or tls_client_ca_file, or insecure: "
            "true to accept that",
        )

    def pools(self) -> list[tuple[str, PoolConfig]]:
        """(role, pool) of every pool this mode runs."""
        if self.mode == "colocated":
            return [("colocated", self.colocated)]
        return [("prefill", self.prefill), ("decode", self.decode)]

    def switchable(self) -> bool:
        """Whether its instances may switch between prefill and decode: re-planning on, two
        pools of one-worker instances that no node label pins (a switch keeps its process)."""
        if not self.replan or self.mode != "disaggregated":
            return False
        return all(p.workers_per_instance == 1 and not p.resources for p in (self.prefill, self.decode))

    def scales(self) -> bool:
        """Whether the re-planner may add or remove instances (whole ones: TP x PP and labelled pools
        too): a disaggregated deployment with a pool under replan_max_instances, or of two or more."""
        if not (self.replan and self.replan_scale and self.mode == "disaggregated"):
            return False
        sizes = (self.prefill.num_instances, self.decode.num_instances)
        return any(n < self.replan_max_instances or n > 1 for n in sizes)

    def on_cluster(self) -> "ServingConfig":
        """This config on a running Ray cluster (`disagg serve --cluster`, what `ray up` starts): it
        joins `ray_address` ("auto" unless set) and pins each pool to the nodes labelled with the
        pool's name (disagg.cluster.node_labels), which the server waits for."""
        pinned = {
            role: dataclasses.replace(pool, resources={role: POOL_LABEL_SLIVER, **pool.resources})
            for role, pool in self.pools()
        }
        return dataclasses.replace(self, ray_address=self.ray_address or "auto", **pinned)

    def frontend_inflight_limit(self) -> int:
        """One frontend's share of inflight_limit(), so that N frontends together admit the bound."""
        return max(1, -(-self.inflight_limit() // self.frontends))

    def frontend(self, index: int) -> "ServingConfig":
        """The settings of frontend `index` (0: this process's): its ports, and no start-up
        requests of its own (the warm-up and calibration ran through frontend 0)."""
        if index == 0:
            return self
        metrics = self.metrics_port + index if self.metrics_port else self.metrics_port
        return dataclasses.replace(
            self,
            port=self.port + index if self.port else 0,
            http_port=self.http_port + index if self.http_port else 0,
            metrics_port=metrics,
            warm_up=False,
            calibration_s=0.0,
        )

    def inflight_limit(self) -> int:
        """`max_inflight_requests`, or (None) as many requests as the decode (or colocated) pool
        runs at once: more would only queue, and refusing them at once is better than letting
        every request wait and miss its SLOs together."""
        if self.max_inflight_requests is not None:
            return self.max_inflight_requests
        _, pool = self.pools()[-1]
        return pool.num_instances * self.pool_engine_config(pool).max_num_seqs

    def pool_engine_config(self, pool: PoolConfig, index: int = 0) -> EngineConfig:
        """The engine settings of the pool's instance `index` (its rank-0 worker; the others
        differ only in their ranks): the shared ones, the pool's, then the instance's own."""
        parallel = ParallelConfig(
            pool.tensor_parallel_size, pool.pipeline_parallel_size, enable_expert_parallel=pool.enable_expert_parallel
        )
        own = pool.instance_override(index).get("engine") or {}
        engine = self.engine.replace(**{**pool.engine, **own, "parallel": parallel})
        if engine.gpu_memory_utilization is None and 0 < pool.num_gpus_per_worker < 1:
            # A worker given part of a GPU may take that part of its memory (gpu_memory_utilization).
            engine = engine.replace(gpu_memory_utilization=pool.num_gpus_per_worker)
        return engine

    def worker_threads(self, pool: PoolConfig, index: int = 0) -> int:
        """Torch threads of each worker of the pool's instance `index`."""
        return pool.instance_override(index).get("threads_per_worker", self.threads_per_worker)

    @classmethod
    def from_dict(cls, data: dict) -> "ServingConfig":
        data = dict(data or {})
        _no_unknown(cls, data, "config")
        engine = dict(data.pop("engine", {}) or {})
        if "model" in data:  # the one setting everybody changes, allowed at the top level too
            engine["model"] = data.pop("model")
        _no_unknown(EngineConfig, engine, "engine")
        kwargs = {k: v for k, v in data.items() if k not in ("prefill", "decode", "colocated", "slo")}
        if isinstance(kwargs.get("cpu_binding"), bool):  # YAML reads a bare on/off as a boolean
            kwargs["cpu_binding"] = "on" if kwargs["cpu_binding"] else "off"
        for pool in ("prefill", "decode", "colocated"):
            if pool in data:
                _no_unknown(PoolConfig, data[pool] or {}, pool)
                kwargs[pool] = PoolConfig(**(data[pool] or {}))
        if "slo" in data:
            _no_unknown(SLO, data["slo"] or {}, "slo")
            kwargs["slo"] = SLO(**(data["slo"] or {}))
        return cls(engine=EngineConfig(**engine), **kwargs)

    @classmethod
    def from_yaml(cls, path: str) -> "ServingConfig":
        return cls.from_dict(read_yaml_settings(path))


def setting_groups() -> dict[str, type]:
    """{name: config class} of the ServingConfig fields that are groups of settings (engine, the
    pools, slo): a config file nests them, flags prefix them (`--engine.max-num-seqs`)."""
    hints = field_types(ServingConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(ServingConfig) if dataclasses.is_dataclass(hints[f.name])}


# EngineConfig fields that are not settings of a serving config: each pool's workers get theirs.
SET_BY_POOLS = ("role", "parallel")


def merge_settings(base: dict, overrides: dict) -> dict:
    """`overrides` over `base`, both settings as a config file holds them: within a group (engine,
    a pool, slo) setting by setting, elsewhere (a mapping or list setting too) value by value.
    A top-level `model` counts as engine.model."""
    merged = _model_in_engine(base)
    groups = setting_groups()
    for name, value in _model_in_engine(overrides).items():
        nested = name in groups and isinstance(value, dict) and isinstance(merged.get(name), dict)
        merged[name] = {**merged[name], **value} if nested else value
    return merged


def _model_in_engine(settings: dict) -> dict:
    settings = dict(settings or {})
    engine = settings.get("engine") or {}
    if "model" in settings and isinstance(engine, dict):  # else from_dict names what is wrong
        settings["engine"] = {**engine, "model": settings.pop("model")}
    return settings


def _no_unknown(cls, data: dict, where: str) -> None:
    if not isinstance(data, dict):
        raise InvalidRequestError(where, "must be a mapping")
    known = {f.name for f in dataclasses.fields(cls)} | ({"model"} if cls is ServingConfig else set())
    unknown = sorted(set(data) - known)
    if unknown:
        raise InvalidRequestError(where, f"unknown setting(s) {unknown}; known: {sorted(known)}")


def read_yaml_settings(path: str) -> dict:
    """A config file's settings, not yet checked (ServingConfig.from_dict checks them)."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise InvalidRequestError("config", f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise InvalidRequestError("config", f"{path} is not valid YAML: {exc}") from None
    if data is not None and not isinstance(data, dict):
        raise InvalidRequestError("config", f"{path} must hold a mapping")
    return data or {}
