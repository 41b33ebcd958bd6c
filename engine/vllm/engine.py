"""vLLM's engine behind warmgate's engine API: the same RequestStreams, on the same HTTP server, as the native one.

vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the worker is the engine, so the
gateway's liveness checks, drains and kills reach it directly, and one process holds the cache's lease.
A thread steps vLLM's ``LLMEngine`` and hands each step's tokens to the server's loop, as the native
engine's scheduler thread does. vLLM sees token ids only (``skip_tokenizer_init``): warmgate's tokenizer,
chat template, stop strings and internal stream (token ids for resume) are the native engine's.

Resume: a request resumed from another engine is submitted as prompt + the tokens already generated,
with the rest of its max_tokens. Greedy requests continue exactly; vLLM has no way to skip a seeded
sampler's draws, so a seeded sampled request continues from a fresh draw of the same seed. A structured
output's grammar replays the tokens already generated (engine/vllm/grammar.py).
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from cache.processors import compute_dtype
from cache.processors.vllm import LOAD_FORMAT, engine_args
from common.device import resolve_device
from common.events import log_event
from engine.config import EngineConfig
from engine.memory_plan import default_max_num_seqs
from engine.request_stream import EngineThread, RequestStream, TokenEvent, TokenLogprobs
from engine.sampling_params import LOGPROB_FLOOR, SamplingParams, check_request
from engine.tokenizer import model_eos_ids
from engine.vllm.grammar import KEY as GRAMMAR_KEY
from engine.vllm.grammar import REGISTRY, Registered
from engine.vllm.grammar import processor as grammar_processor
from engine.weights import WeightOrigin

log = logging.getLogger("warmgate.engine.vllm")

DEFAULT_MAX_MODEL_LEN = 4096
CPU_KV_CACHE_BYTES = 1 << 30  # vLLM on CPU needs an explicit KV size; the gateway's kv_cache_bytes overrides it
FINISH = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}


@dataclass(frozen=True)
class _Vllm:
    """What this module uses of vLLM (imported once, by the worker or ahead of forks by the fork server)."""

    SamplingParams: Any
    TokensPrompt: Any
    DELTA: Any
    EngineArgs: Any
    LLMEngine: Any


def import_vllm() -> _Vllm:
    """Import vLLM's engine and register the warmgate load format in this process."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.llm_engine import LLMEngine

    import engine.vllm.loader  # noqa: F401  (registers the load format)

    return _Vllm(SamplingParams, TokensPrompt, RequestOutputKind.DELTA, EngineArgs, LLMEngine)


@dataclass
class _Pending:
    stream: RequestStream
    prompt: list[int]
    params: Any  # vllm.SamplingParams


class VllmEngine(EngineThread[_Pending]):
    """Build vLLM's engine (blocking; its weights through the warmgate load format), then ``start()``."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self.config = config
        self.startup_phases: dict[str, float] = {}
        t = time.perf_counter()
        vllm = import_vllm()
        self._sampling, self._prompt, self._delta = vllm.SamplingParams, vllm.TokensPrompt, vllm.DELTA
        self.startup_phases["vllm_import"] = time.perf_counter() - t

        t = time.perf_counter()
        self.device = resolve_device(config.device)
        dtype = compute_dtype(self.device, config.dtype, "vllm")
        model_config = json.loads((config.model / "config.json").read_text())
        self.vocab_size = int(model_config["vocab_size"])
        self.max_model_len = min(config.max_model_len or DEFAULT_MAX_MODEL_LEN,
                                 int(model_config.get("max_position_embeddings", DEFAULT_MAX_MODEL_LEN)))  # fmt: skip
        self.eos_token_ids = model_eos_ids(model_config, config.model)
        self.max_num_seqs = config.max_num_seqs or default_max_num_seqs(self.device.type)
        kv_bytes = config.kv_cache_bytes or (CPU_KV_CACHE_BYTES if self.device.type == "cpu" else None)
        self.memory = {"max_num_seqs": self.max_num_seqs, "max_model_len": self.max_model_len,
                       "kv_cache_budget": kv_bytes, "device": None}  # fmt: skip
        args = engine_args(
            config.model, self.device, dtype,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max(config.max_num_batched_tokens, self.max_model_len),
            load_format=LOAD_FORMAT,
            model_loader_extra_config={"cache_socket": str(config.cache_socket or ""), "weights": config.weights,
                                       "engine_name": f"vllm-engine-{os.getpid()}"},
            disable_log_stats=True,
            enable_prefix_caching=config.enable_prefix_caching,
            kv_cache_dtype=config.kv_cache_dtype,  # the same two names as vLLM's
            logprobs_mode="processed_logprobs",  # of the distribution sampled from, as the native engine reports
            logits_processors=[grammar_processor()],  # structured outputs with warmgate's grammars (resumable)
            **({"kv_cache_memory_bytes": kv_bytes} if kv_bytes else {}),
            **({"enforce_eager": True} if not config.cuda_graphs else {}),
        )  # fmt: skip
        self.llm = vllm.LLMEngine.from_engine_args(vllm.EngineArgs(**args))
        self.startup_phases["vllm_engine"] = time.perf_counter() - t
        origin = self.llm.apply_model(lambda model: model.warmgate_origin)[0]
        self._origin: WeightOrigin = origin

        self._streams: dict[str, RequestStream] = {}
        self._top_logprobs: dict[str, int] = {}  # request id -> alternatives it asks for, if it asks for logprobs
        self._prompt_logprobs: dict[str, tuple[list[int], int]] = {}  # request id -> (prompt, alternatives): echo
        self._score_only: set[str] = set()  # max_tokens 0: vLLM generates one token, which nobody gets
        # request id -> the tokens it asked vLLM to compute, until its first output says how many were cached
        self._unopened: dict[str, int] = {}
        self._prefix_queries = self._prefix_hits = 0  # vLLM's prefix_cache_queries / prefix_cache_hits, as counted here
        t = time.perf_counter()
        self._warm_up()
        self.startup_phases["warmup"] = time.perf_counter() - t
        log_event(log, "vllm_engine", source=origin.source, kv_cache_bytes=kv_bytes, **self.startup_phases)

    def _warm_up(self) -> None:
        """One short request through vLLM before the worker reports ready (first-step costs are paid here). It asks
        for logprobs: vLLM's first logprobs step took 3.7 s on an idle 2-core CPU, over 10 s (health_timeout) under
        load, where it got the engine killed as hung."""
        params = self._sampling(max_tokens=2, temperature=0, ignore_eos=True, detokenize=False, logprobs=2)
        self.llm.add_request("warmup", self._prompt(prompt_token_ids=[self.eos_token_ids[0]] * 4), params)
        while self.llm.has_unfinished_requests():
            self.llm.step()

    # -- the engine API (engine/server.py's ServingEngine) ---------------------------------

    @property
    def weight_origin(self) -> WeightOrigin:
        return self._origin

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               output_ids: list[int] | None = None) -> RequestStream:  # fmt: skip
        """Queue a request (on the loop that iterates the stream); ``output_ids``: a resume, see the module doc."""
        import asyncio

        check_request(prompt_ids, params, self.max_model_len, output_ids)
        output = list(output_ids or [])
        stop_ids = [*params.stop_token_ids, *([] if params.ignore_eos else self.eos_token_ids)]
        vllm_params = self._sampling(
            max_tokens=max(1, params.max_tokens - len(output)), temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k, seed=params.seed, presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty, stop_token_ids=stop_ids, ignore_eos=params.ignore_eos,
            detokenize=False, output_kind=self._delta, logprobs=params.logprobs,
            prompt_logprobs=params.prompt_logprobs,
        )  # fmt: skip
        stream = RequestStream(request_id or uuid.uuid4().hex, len(prompt_ids), asyncio.get_running_loop(),
                               self._outbox)  # fmt: skip
        if params.grammar is not None:
            REGISTRY[stream.request_id] = Registered(params.grammar, output)
            vllm_params.extra_args = {GRAMMAR_KEY: stream.request_id}
        if params.prompt_logprobs is not None:
            self._prompt_logprobs[stream.request_id] = (list(prompt_ids), params.prompt_logprobs)
        if params.max_tokens == 0:
            self._score_only.add(stream.request_id)
        self._unopened[stream.request_id] = len(prompt_ids) + len(output)
        self._enqueue(_Pending(stream, [*prompt_ids, *output], vllm_params))
        return stream

    def activate(self, timeout: float) -> Future[float]:
        """Nothing to commit: vLLM allocates its KV cache at start (a standby of this backend holds its own)."""
        done: Future[float] = Future()
        done.set_result(0.0)
        return done

    def device_memory_bytes(self) -> int:
        import torch

        return int(torch.cuda.memory_reserved(self.device)) if self.device.type == "cuda" else 0

    @property
    def num_running(self) -> int:
        return self._load()[0]

    @property
    def num_waiting(self) -> int:
        return self._load()[1]

    @property
    def num_preemptions(self) -> int:
        return 0  # vLLM counts its preemptions in its own metrics, which this API does not relay

    @property
    def prefix_cache(self) -> tuple[int, int]:
        """Tokens of the requests vLLM began since the engine started, and those of them it found cached (from each
        request's first output, as the native engine counts them at admission)."""
        return self._prefix_queries, self._prefix_hits

    @property
    def kv_blocks_free(self) -> int:
        pool = self._block_pool()
        return int(pool.get_num_free_blocks()) if pool is not None else 0

    @property
    def kv_blocks_total(self) -> int:
        pool = self._block_pool()
        return int(pool.num_gpu_blocks) if pool is not None else 0

    def _block_pool(self) -> Any:
        scheduler = self._scheduler()
        try:
            return scheduler.kv_cache_manager.block_pool if scheduler is not None else None
        except AttributeError:  # another vLLM layout: /health reports 0 rather than failing
            return None

    def _scheduler(self) -> Any:
        """vLLM's scheduler (in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0), or None in a layout we do not know."""
        try:
            return self.llm.engine_core.engine_core.scheduler
        except AttributeError:
            return None

    # -- the stepping thread (engine/request_stream.py's EngineThread) -----------------------

    def _idle(self) -> bool:
        return not self._streams

    def _work(self, pending: list[_Pending]) -> None:
        self._admit(pending)
        self._abort_cancelled()
        if self._streams:
            self._deliver(self.llm.step())

    def _abort_all(self) -> None:
        for stream in [*self._streams.values(), *(p.stream for p in self._inbox)]:
            stream.push(TokenEvent(None, "abort"))
        self._streams.clear()
        self._top_logprobs.clear()
        self._prompt_logprobs.clear()
        self._score_only.clear()
        self._unopened.clear()
        REGISTRY.clear()

    def _admit(self, pending: list[_Pending]) -> None:
        for p in pending:
            try:
                self.llm.add_request(p.stream.request_id, self._prompt(prompt_token_ids=p.prompt), p.params)
            except Exception as exc:  # vLLM refused it: that request fails, the others go on
                p.stream.push(TokenEvent(None, "error", error=f"{type(exc).__name__}: {exc}"))
                REGISTRY.pop(p.stream.request_id, None)
                continue
            self._streams[p.stream.request_id] = p.stream
            if p.params.logprobs is not None:
                self._top_logprobs[p.stream.request_id] = p.params.logprobs

    def _abort_cancelled(self) -> None:
        cancelled = [rid for rid, stream in self._streams.items() if stream.cancelled]
        if cancelled:
            self.llm.abort_request(cancelled)
            for rid in cancelled:
                self._drop(rid).push(TokenEvent(None, "abort"))

    def _deliver(self, outputs: list[Any]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            completion = out.outputs[0]
            reason = FINISH.get(completion.finish_reason or "", "stop") if out.finished else None
            ids = list(completion.token_ids)
            top = self._top_logprobs.get(out.request_id, 0)
            logprobs = completion.logprobs or [None] * len(ids)
            prompt = self._prompt_scores(out)
            cached = self._cached_tokens(out, stream)
            if out.request_id in self._score_only:  # the prompt scored: its one generated token is dropped
                stream.push(TokenEvent(None, "length", prompt_logprobs=prompt, cached_tokens=cached))
                if not out.finished:
                    self.llm.abort_request([out.request_id])
                self._drop(out.request_id)
                continue
            for i, (token, alternatives) in enumerate(zip(ids, logprobs, strict=True)):
                stream.push(TokenEvent(token, reason if i == len(ids) - 1 else None,
                                       logprobs=_token_logprobs(token, alternatives, top),
                                       prompt_logprobs=prompt if i == 0 else None,
                                       cached_tokens=cached if i == 0 else 0))  # fmt: skip
            if out.finished:
                if not ids:
                    stream.push(TokenEvent(None, reason))
                self._drop(out.request_id)

    def _cached_tokens(self, out: Any, stream: RequestStream) -> int:
        """The prompt's tokens vLLM found in its prefix cache, on the request's first output (a resume's prompt
        holds the tokens generated before it: those are not the client's prompt), counted in ``prefix_cache``."""
        asked = self._unopened.pop(out.request_id, None)
        if asked is None:
            return 0
        cached = getattr(out, "num_cached_tokens", None) or 0
        if self.config.enable_prefix_caching:
            self._prefix_queries += asked
            self._prefix_hits += cached
        return min(cached, stream.prompt_tokens)

    def _prompt_scores(self, out: Any) -> tuple[TokenLogprobs | None, ...] | None:
        """The prompt's logprobs, on the request's first output (vLLM's: the first token's is None)."""
        asked = self._prompt_logprobs.pop(out.request_id, None)
        if asked is None:
            return None
        prompt, top = asked
        scores = out.prompt_logprobs or [None] * len(prompt)
        return tuple(_token_logprobs(t, a, top) if a is not None else None
                     for t, a in zip(prompt, scores, strict=False))  # fmt: skip

    def _drop(self, request_id: str) -> RequestStream:
        self._top_logprobs.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)
        self._score_only.discard(request_id)
        self._unopened.pop(request_id, None)
        REGISTRY.pop(request_id, None)
        return self._streams.pop(request_id)

    def _description(self) -> tuple[str, int, int]:
        # vLLM chooses the block size; its usage leaves out the null block (vllm.v1.core.block_pool.get_usage).
        pool = self._block_pool()
        block_size = int(self.llm.vllm_config.cache_config.block_size)
        return self.config.name, block_size, int(pool.num_gpu_blocks) - 1 if pool is not None else 0

    def _load(self) -> tuple[int, int, int, int, int]:
        """vLLM's own scheduler queues (``self._streams`` counts its running and waiting requests together)."""
        scheduler, pool = self._scheduler(), self._block_pool()
        if scheduler is None or pool is None:
            return len(self._streams), len(self._inbox), 0, *self.prefix_cache
        used = int(pool.num_gpu_blocks) - 1 - int(pool.get_num_free_blocks())
        return len(scheduler.running), len(scheduler.waiting) + len(self._inbox), used, *self.prefix_cache

    def _fail(self, error: str) -> None:
        rids = list(self._streams)
        for rid in rids:
            self._drop(rid).push(TokenEvent(None, "error", error=error))
        try:
            self.llm.abort_request(rids)
        except Exception:  # the engine is already broken; its requests are failed above
            log.exception("event=abort_failed")


def _token_logprobs(token: int, alternatives: dict[int, Any] | None, top: int) -> TokenLogprobs | None:
    """vLLM's logprobs of one token (id -> Logprob: the sampled token's, and the ``top`` most likely) as ours."""
    if alternatives is None:
        return None
    best = sorted(alternatives.items(), key=lambda item: -item[1].logprob)[:top]
    return TokenLogprobs(max(alternatives[token].logprob, LOGPROB_FLOOR),
                         tuple((i, max(a.logprob, LOGPROB_FLOOR)) for i, a in best))  # fmt: skip
