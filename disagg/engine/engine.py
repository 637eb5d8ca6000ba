"""One engine instance: add_request / step / abort, in any role.

The engine owns the model, the KV cache, the block manager and the scheduler of one instance.
It imports no Ray, gRPC or Redis: the workers wrap it, and its KV connector (kv_connector.py)
moves the KV. In the PREFILL role a request ends after its first token with its blocks held
until `release_kv`; in the DECODE role a request's blocks are reserved up front
(`reserve_for_remote_prefill`), filled by the connector, and it decodes after `finish_kv_import`.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections import deque

import torch

from disagg.config import EngineConfig, Role, require_weights_on
from disagg.engine.block_manager import BlockManager
from disagg.engine.cuda_graphs import DecodeGraphs
from disagg.engine.distributed import InstanceGroups
from disagg.engine.grammar import GrammarCompiler
from disagg.engine.guided_decoding import GrammarError, GuidedDecoding
from disagg.engine.kv_cache import KVCache
from disagg.engine.kv_tiers.tiered_store import TieredStore
from disagg.engine.kv_tiers.build import build_tiered_store
from disagg.engine.kv_connector import Followers, KVConnector
from disagg.engine.layers.attention import select_decode_kernel
from disagg.engine.layers.cpu_gemm import bound_onednn_caches
from disagg.engine.layers.quantized import wide_dtype_for
from disagg.engine.length_prediction import load_length_ranker, predict_output_len
from disagg.engine.device_memory import available_memory
from disagg.engine.loader import load_model_source
from disagg.engine.memory_fit import dtype_name, fit_error, kv_block_bytes, kv_num_blocks, memory_need
from disagg.engine.model_runner import ModelRunner
from disagg.engine.models import build_model
from disagg.engine.models.causal_lm import Backends, CausalLM
from disagg.engine.outputs import CompletionOutput, RequestOutput
from disagg.engine.sampler import Sampler, token_generator
from disagg.engine.scheduler import SampledToken, ScheduledChunk, Scheduler, SchedulerOutput
from disagg.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from disagg.errors import InvalidRequestError, ModelLoadError
from disagg.request import FinishReason, Request, RequestStatus, SamplingParams, check_fits, priority_value
from disagg.step_work import MeasuredStep

logger = logging.getLogger(__name__)
STEP_STATS_KEPT = 512


def _return_freed_memory() -> None:
    """Give the heap's free pages back to the OS. glibc keeps freed memory for reuse, so the dense
    weights a quantized model was made from would stay in its RSS (hundreds of MiB)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, weights: str = "auto") -> torch.dtype:
    return getattr(torch, dtype_name(dtype, device.type, weights))


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        groups: InstanceGroups | None = None,
        kv_connector: KVConnector | None = None,
        followers: Followers | None = None,
    ):
        """`groups`: this rank's process groups when the instance has several workers (TP x PP);
        every rank builds an engine for its shard, and only rank 0's scheduler is used.
        `kv_connector`: what moves this rank's KV (disagg.kv_transfer); `followers`: rank 0's
        handle on the other ranks."""
        self.config = config
        self.groups = groups
        p = config.parallel
        if p.world_size > 1 and (groups is None or groups.place.world_size != p.world_size):
            raise ValueError(
                f"parallel: an instance of {p.world_size} workers needs its process groups (disagg.engine.distributed.join_instance)"
            )
        # Under ltr, what predicts each request's output length; read before the weights, so
        # that a bad file fails at once. None under fcfs.
        self.length_ranker = load_length_ranker(config)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        require_weights_on(config.weights, self.device.type)  # before any weight is read
        self.dtype = resolve_dtype(config.dtype, self.device, config.weights)
        if self.device.type == "cpu":
            bound_onednn_caches()
        source = load_model_source(
            config.model,
            cache_dir=config.cache_dir,
            tokenizer=config.tokenizer,
            random_dtype=self.dtype,
            random_device=self.device,
        )
        self.model_config = source.config
        self.tokenizer = Tokenizer(source.tokenizer) if source.tokenizer is not None else None
        self.max_model_len = min(
            config.max_model_len or source.config.max_position_embeddings, source.config.max_position_embeddings
        )
        self._check_memory_fits(source)
        self.model = self._build_model(source)
        self.kv_cache = self._build_kv_cache()
        self.kv_tiers = self._build_kv_tiers()
        self.block_manager = self._new_block_manager(config)
        self.scheduler = self._new_scheduler(config, self.block_manager)
        self.kv_connector = kv_connector
        if kv_connector is not None:
            kv_connector.register_kv_cache(self.kv_cache)
        decode_kernel = select_decode_kernel(self.device, config.attention_backend)
        self.runner = ModelRunner(
            self.model,
            self.kv_cache,
            Sampler(config.seed),
            self.device,
            decode_kernel=decode_kernel,
            kv_connector=kv_connector,
            followers=followers,
            pipe=groups.pipe if groups is not None else None,
            returns_logits=groups is None or groups.place.tp_rank == 0,
            decode_graphs=self._decode_graphs(decode_kernel, kv_connector),
            rows_as_decodes=config.batch_invariant,
        )
        self.guided = GuidedDecoding(self._grammar_compiler, config.jump_forward)
        self._compiler: GrammarCompiler | None = None
        self.last_step_seconds = 0.0
        # The latest steps, for the worker's reports (appended here, read from another thread).
        self.step_stats: deque[MeasuredStep] = deque(maxlen=STEP_STATS_KEPT)
        self.num_steps = 0

    # ---- construction ------------------------------------------------------------------------
    def _new_block_manager(self, config: EngineConfig) -> BlockManager:
        window = self.model_config.shared_window
        return BlockManager(
            self.kv_cache.num_blocks, config.block_size, config.enable_prefix_caching, window, lower=self.kv_tiers
        )

    def _build_kv_tiers(self) -> TieredStore | None:
        """The tiers under the pool (config kv_host_tier_bytes, kv_disk_tier_*), or None where
        they do not apply: no prefix caching, a sliding window (its blocks are released as they
        leave it), or several ranks (each holds a slice of every block: a tier would need each
        rank's copy; not yet)."""
        c = self.config
        if not c.enable_prefix_caching or self.model_config.shared_window is not None or self.groups is not None:
            return None
        return build_tiered_store(c, self.kv_cache)

    def _new_scheduler(self, config: EngineConfig, block_manager: BlockManager) -> Scheduler:
        return Scheduler(
            block_manager,
            role=config.role,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_waiting_requests=config.max_waiting_requests,
            max_model_len=self.max_model_len,
            policy=config.scheduling_policy,
            order=config.scheduling_order,
            priority_aging_s=config.priority_aging_s,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            attention_context_tokens=self.model_config.attention_context_tokens
            if config.long_prefill_by_work
            else None,
        )

    def _grammar_compiler(self) -> GrammarCompiler:
        if self.tokenizer is None:
            raise InvalidRequestError("structured", "structured output needs a tokenizer; this model has none")
        if self._compiler is None:
            tokenizer = self.tokenizer
            self._compiler = GrammarCompiler(
                tokenizer.hf_tokenizer, self.model_config.vocab_size, tokenizer.eos_token_ids
            )
        return self._compiler

    def _check_memory_fits(self, source) -> None:
        """Before anything is allocated: this rank's weights, KV cache and activations must fit
        what its device leaves it (memory_fit.py), or it is refused with the figures."""
        place = self.groups.place if self.groups is not None else None
        pp_rank = place.pp_rank if place is not None else 0
        from_gguf = source.gguf_path is not None
        need = memory_need(self.model_config, self.config, self.device.type, from_gguf=from_gguf, pp_rank=pp_rank)
        available, where = available_memory(self.device, self.config.gpu_memory_utilization)
        error = fit_error(need, available, where)
        if error:
            raise ModelLoadError(f"{self.config.model} ({self.config.role} worker): {error}")

    def _build_model(self, source) -> CausalLM:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)  # build parameters directly in the target dtype
        try:
            with torch.device(self.device):
                place = self.groups.place if self.groups is not None else None
                backends = Backends(self.config.attention_backend, self.config.cpu_gemm, self.config.fused_layer)
                if place is None:
                    model = build_model(source.config, self.max_model_len, backends=backends)
                else:
                    model = build_model(
                        source.config,
                        self.max_model_len,
                        tp=self.groups.tp,
                        pp_rank=place.pp_rank,
                        pp_size=place.pp_size,
                        backends=backends,
                        expert_parallel=self.config.parallel.enable_expert_parallel,
                    )
        finally:
            torch.set_default_dtype(previous)
        # A GGUF's quantized blocks stay quantized where the kernels are (CPU); asked for, anywhere.
        weights = self.config.weights
        quantized = weights in ("int8", "int4") or (weights == "auto" and self.device.type == "cpu")
        model.load_weights(source.iter_weights(), pack=not quantized)
        if weights == "fp8":  # CUDA only (require_weights_on)
            logger.info(model.fp8_weights())
            torch.cuda.empty_cache()  # the bf16 copies just freed, back for the KV cache
        if quantized:
            # The copy for prompt rows, in prompt_precision on every instance (a decode instance
            # computes prompts after a role switch or a preemption, and must compute them alike).
            wide_dtype = wide_dtype_for(self.config.prompt_precision)
            model.quantize_weights(weights, source.gguf_types(), wide_dtype)
            if self.config.batch_invariant:
                model.every_row_quantized()
            model.pack_gemms()  # what stays dense (none, or a float checkpoint's under auto)
            _return_freed_memory()  # the dense float32 copies just freed
        return model.eval()

    def _decode_graphs(self, kernel, kv_connector: KVConnector | None) -> DecodeGraphs | None:
        """Decode steps as CUDA graphs where they can be captured (cuda_graphs.py says where);
        None: every step eager."""
        streams_kv = kv_connector is not None and kv_connector.saves_layers
        if self.config.enforce_eager or self.device.type != "cuda" or kernel is None:
            return None
        if self.config.role == Role.PREFILL:  # it samples first tokens only: no decode steps
            return None
        if self.groups is not None or streams_kv or not self.model.captures_cuda_graphs:
            return None
        graphs = DecodeGraphs(
            self.model,
            self.kv_cache,
            kernel,
            self.device,
            max_batch=self.config.max_num_seqs,
            max_blocks_per_seq=-(-self.max_model_len // self.config.block_size),
        )
        graphs.capture()
        return graphs

    def _build_kv_cache(self) -> KVCache:
        cfg, c, p = self.model_config, self.config, self.config.parallel
        num_kv_heads = cfg.num_key_value_heads // p.tensor_parallel_size
        # Every rank of an instance sizes its cache for the largest stage, so that all ranks
        # have the same number of blocks: rank 0's block ids are valid everywhere (memory_fit).
        dtype_bytes = self.dtype.itemsize
        per_block = kv_block_bytes(cfg, c, dtype_bytes)
        num_blocks = kv_num_blocks(cfg, c, dtype_bytes)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, c.block_size, num_blocks * per_block / 2**20
        )
        # A prefill cache is read by the transfer, and so is a decode cache whose requests move
        # (disagg.decode_worker.migration): shared, a worker on this host copies from it directly
        # (kv_shared_memory off: always send over the transport).
        shared = c.role in (Role.PREFILL, Role.DECODE) and c.kv_shared_memory
        place = self.groups.place if self.groups is not None else None
        head_offset = place.tp_rank * num_kv_heads if place is not None else 0
        return KVCache(
            self.model.num_local_layers,
            num_blocks,
            c.block_size,
            num_kv_heads,
            cfg.head_dim,
            self.dtype,
            self.device,
            shared=shared,
            layer_offset=self.model.start_layer,
            head_offset=head_offset,
        )

    # ---- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int | str = 0,
    ) -> Request:
        """`priority`: vLLM's (lower runs first, 0 by default) or our name of one (critical,
        standard, sheddable): it orders the queue, the batch and preemption (disagg.engine.queue_order)."""
        request = self._make_request(request_id, prompt, prompt_token_ids, sampling_params, arrival_time, priority)
        self.scheduler.add_request(request)
        self._track(request, prompt)
        return request

    def _make_request(self, request_id, prompt, prompt_token_ids, sampling_params, arrival_time, priority) -> Request:
        params = sampling_params or SamplingParams()
        priority = priority_value(priority)
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params", "must be a SamplingParams")
        params.validate()
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop", "stop strings need a tokenizer; this model has none")
        if params.structured is not None:
            self._grammar_compiler().check(params.structured)
        token_ids = self._prompt_token_ids(prompt, prompt_token_ids)
        bm = self.block_manager
        held = self._max_blocks_held(len(token_ids), params.max_tokens)
        check_fits(len(token_ids), params.max_tokens, self.max_model_len, bm.block_size, bm.num_total_blocks, "", held)
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else self.model_config.eos_token_ids
        request = Request(
            str(request_id),
            token_ids,
            params,
            eos_token_ids=tuple(eos),
            arrival_time=arrival_time or time.perf_counter(),
            priority=priority,
        )
        if self.length_ranker is not None:
            request.predicted_output_len = predict_output_len(self.length_ranker, request)
        return request

    def _max_blocks_held(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """The most blocks a request holds at once: every block of its tokens, but fewer under a
        sliding window (its chunks then bound it: chunked, at most a budget's tokens;
        prefill_first computes a whole prompt in one step, and a preempted one's outputs too)."""
        num_tokens = num_prompt_tokens + max_tokens
        chunked = self.config.scheduling_policy != "prefill_first"
        chunk = self.config.max_num_batched_tokens if chunked else num_tokens
        return self.block_manager.max_blocks_held(num_tokens, chunk)

    def _prompt_token_ids(self, prompt, prompt_token_ids) -> list[int]:
        if prompt_token_ids is None:
            if not isinstance(prompt, str) or prompt == "":
                raise InvalidRequestError("prompt", "must be a non-empty string (or give prompt_token_ids)")
            if self.tokenizer is None:
                raise InvalidRequestError("prompt", "this model has no tokenizer; pass prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        ids = list(prompt_token_ids)
        if not ids:
            raise InvalidRequestError("prompt_token_ids", "must not be empty")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise InvalidRequestError("prompt_token_ids", f"must be integers in [0, {vocab})")
        return ids

    def _track(self, request: Request, prompt: str | None) -> None:
        """What its outputs need, held by the request itself (its text, its detokenizer)."""
        request.prompt = prompt
        request.num_reported = 0
        if self.tokenizer is not None:
            request.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids)

    def abort_request(self, request_id: str) -> bool:
        request = self.scheduler.finish_request(str(request_id), RequestStatus.FINISHED_ABORTED)
        return request is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and run one batch; returns outputs of requests with new tokens or that finished.

        An error is confined to the request that caused it: that request ends with `error` set
        and the others of its batch go on (see `_isolate`)."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        started = time.perf_counter()
        sampled, failed = self._execute(plan)
        if self.config.role is not Role.PREFILL:  # a prefill instance samples one token: none follows
            self._follow_grammars(plan, sampled, failed)
        self.last_step_seconds = time.perf_counter() - started
        self.num_steps += 1
        self.step_stats.append(MeasuredStep(plan.work, self.last_step_seconds * 1e3, self.num_steps))
        if failed:
            plan.chunks = [c for c in plan.chunks if c.request.request_id not in failed]
        outputs = [self._fail(request, error) for request, error in failed.values()]
        for request in self.scheduler.update_from_output(plan, sampled):
            try:
                outputs.append(self._output(request))
            except Exception as exc:  # e.g. detokenizing: this request's fault, not its batch's
                outputs.append(self._fail(request, exc))
        return outputs

    def _execute(self, plan: SchedulerOutput) -> tuple[dict[str, SampledToken], dict[str, tuple[Request, Exception]]]:
        try:
            return self.runner.execute(plan, self._token_generator, self.guided.mask), {}
        except Exception as exc:
            if self.groups is not None:  # the other ranks ran it in lockstep: no rank may retry alone
                raise
            logger.warning("a step of %d requests failed (%s); retrying them in halves", len(plan.chunks), exc)
            return self._isolate(plan.chunks, exc)

    def _isolate(self, chunks: list[ScheduledChunk], exc: Exception):
        """Run the chunks of a failed step again, in halves, until each failure is pinned on one
        request. Rerunning a chunk is harmless: it writes the same KV to the same slots, and a
        seeded request draws the same token (the generator is a function of its position)."""
        if self.kv_connector is not None:
            self.kv_connector.step_failed(chunks)
        if len(chunks) == 1:
            return {}, {chunks[0].request.request_id: (chunks[0].request, exc)}
        sampled, failed = {}, {}
        middle = len(chunks) // 2
        for half in (chunks[:middle], chunks[middle:]):
            try:
                sampled.update(self.runner.execute(SchedulerOutput(half), self._token_generator, self.guided.mask))
            except Exception as half_exc:
                half_sampled, half_failed = self._isolate(half, half_exc)
                sampled.update(half_sampled)
                failed.update(half_failed)
        return sampled, failed

    def _follow_grammars(self, plan: SchedulerOutput, sampled: dict[str, SampledToken], failed: dict) -> None:
        """Each structured request's grammar takes its sampled token; what it forces next rides
        along (jump-forward), and a complete grammar ends the request."""
        for chunk in plan.chunks:
            request = chunk.request
            token = sampled.get(request.request_id)
            if token is None or request.sampling_params.structured is None:
                continue
            try:
                token.forced, token.ends = self.guided.advance(request, token.token_id)
            except GrammarError as exc:
                del sampled[request.request_id]
                failed[request.request_id] = (request, exc)

    def _fail(self, request: Request, exc: Exception) -> RequestOutput:
        """End a request that failed in a step; its output carries the error."""
        logger.error("request %s failed in a step: %s: %s", request.request_id, type(exc).__name__, exc)
        self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ABORTED)
        out = RequestOutput(
            request.request_id,
            None,
            request.prompt_token_ids,
            [CompletionOutput(0, "", list(request.output_token_ids), str(FinishReason.ABORT))],
            finished=True,
            metrics=request.timings,
        )
        out.error = f"{type(exc).__name__}: {exc}"
        return out

    def _token_generator(self, request: Request):
        """The generator for the token a seeded request samples now (disagg.engine.sampler)."""
        params = request.sampling_params
        return token_generator(params.seed, params.resumed_tokens + request.num_output_tokens, self.device)

    def _output(self, request: Request) -> RequestOutput:
        rid = request.request_id
        new_ids = request.output_token_ids[request.num_reported :]
        request.num_reported = request.num_output_tokens
        new_text = self._detokenize(request, new_ids)
        detok = request.detokenizer
        finished = request.is_finished or request.status is RequestStatus.HELD_FOR_EXPORT
        out = RequestOutput(
            request_id=rid,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    0,
                    detok.text if detok else "",
                    list(request.output_token_ids),
                    str(request.finish_reason) if request.finish_reason else None,
                    request.stop_reason,
                    list(request.output_logprobs) or None,
                )
            ],
            finished=finished,
            metrics=request.timings,
            new_token_ids=new_ids,
            new_text=new_text,
            num_cached_tokens=request.num_cached_tokens,
            num_preemptions=request.num_preemptions,
        )
        return out

    def _detokenize(self, request: Request, new_ids: list[int]) -> str:
        """Text delta of the new tokens; finishes the request when a stop string appears."""
        detok = request.detokenizer
        if detok is None or not new_ids:
            return ""
        before = len(detok.text)
        detok.add_tokens(new_ids)
        stop_at = self._find_stop_string(request, detok, before)
        if stop_at is not None and not request.is_finished:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        return detok.text[before:]

    @staticmethod
    def _find_stop_string(request: Request, detok: IncrementalDetokenizer, before: int) -> int | None:
        params = request.sampling_params
        for stop in params.stop:
            index = detok.text.find(stop, max(0, before - len(stop) + 1))
            if index != -1:
                end = index + (len(stop) if params.include_stop_str_in_output else 0)
                detok.truncate(end)
                request.stop_reason = stop
                return end
        return None

    # ---- disaggregation: KV export (PREFILL) and import (DECODE) -----------------------------
    def release_kv(self, request_id: str) -> None:
        self.scheduler.release(request_id)

    def reserve_for_remote_prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int | str = 0,
    ) -> list[int] | None:
        """DECODE role: pre-allocate the prompt's blocks; None when there is no room now."""
        request = self._make_request(request_id, None, prompt_token_ids, sampling_params, arrival_time, priority)
        if not self.scheduler.reserve_for_remote_prefill(request):
            return None
        self._track(request, None)
        return list(request.block_ids)

    def finish_kv_import(self, request_id: str, first_token_id: int) -> RequestOutput:
        """The prompt's KV is in place: decode from the first token on. Returns the first token's output."""
        request = self.scheduler.finish_kv_import(request_id, first_token_id)
        return self._output(request)

    # ---- role switch: the same weights serve another pool (disagg.worker.actor.switch_role) ---
    def switch_role(self, role: Role, kv_connector: KVConnector | None) -> None:
        """Serve as `role` from now on, with `kv_connector` moving its KV: the scheduler, block
        table and connector are made anew; the weights and the KV memory stay. Only an engine
        that holds no request switches (drain it first); anything that fails leaves it as it
        was: built first, swapped in last."""
        if self.scheduler.requests:
            raise ValueError(f"switch_role: {len(self.scheduler.requests)} requests still here; drain first")
        if self.groups is not None:
            raise ValueError("switch_role: an instance of several ranks cannot switch roles yet")
        config = self.config.replace(role=role)
        block_manager = self._new_block_manager(config)
        scheduler = self._new_scheduler(config, block_manager)
        if kv_connector is not None:
            kv_connector.register_kv_cache(self.kv_cache)
        self.config, self.block_manager, self.scheduler = config, block_manager, scheduler
        self.kv_connector = kv_connector
        self.runner.kv_connector = kv_connector if kv_connector is not None and kv_connector.saves_layers else None

    # ---- live migration: a decoding request moves with its KV (disagg.decode_worker.migration) ---
    def pause_request(self, request_id: str) -> list[int]:
        """Out of the batch, blocks kept; returns its tokens (the last one's KV is not computed)."""
        return list(self.scheduler.pause(request_id).token_ids)

    def resume_request(self, request_id: str) -> None:
        self.scheduler.resume(request_id)

    def release_paused(self, request_id: str) -> None:
        """It runs elsewhere now: free its blocks, with no output (its stream goes on there)."""
        if self.scheduler.holds(request_id, RequestStatus.PAUSED):
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def reserve_for_migration(
        self,
        request_id: str,
        token_ids: list[int],
        sampling_params: SamplingParams,
        capacity_tokens: int,
        priority: int | str = 0,
    ) -> list[int] | None:
        """Blocks for a request arriving with its KV: `token_ids` known so far, room for
        `capacity_tokens` positions; None when there is no room now. `priority`: the one it had
        where it came from."""
        request = self._make_request(request_id, None, token_ids, sampling_params, None, priority)
        if not self.scheduler.reserve_for_migration(request, capacity_tokens):
            return None
        self._track(request, None)
        return list(request.block_ids)

    def finish_migration_import(
        self, request_id: str, token_ids: list[int], last_token: int, sampling_params: SamplingParams
    ) -> RequestOutput:
        """Its KV is in: decode on from `last_token` (see Scheduler.finish_migration_import)."""
        sampling_params.validate()
        request = self.scheduler.finish_migration_import(request_id, token_ids, last_token, sampling_params)
        self._track(request, None)  # the detokenizer starts from the final prompt
        return self._output(request)

    # ---- stats -------------------------------------------------------------------------------
    def expert_tokens(self) -> list[int]:
        """A mixture of experts' per-expert load: tokens routed to each expert since the start,
        summed over this rank's MoE layers ([] for a dense model). Read from any thread."""
        return self.model.expert_tokens()

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_manager.num_total_blocks

    @property
    def peak_num_used_blocks(self) -> int:
        return self.block_manager.peak_num_used_blocks
