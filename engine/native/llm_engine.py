"""The engine core: one model, a paged KV cache, and a scheduler thread doing continuous batching.

The HTTP server talks to it through ``submit`` (from its asyncio loop) and iterates the
returned RequestStream; everything blocking (model forward, sampling) runs on the
engine's own thread. A step's token events reach the loop in one hand-over, not one per token:
the thread that feeds the GPU does no text work and wakes the loop once per step.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from cache.arena import preload_transport
from cache.processors.native import compute_dtype
from common.device import resolve_device
from common.events import log_event
from engine.config import EngineConfig
from engine.grammar import GrammarState, TokenMasks
from engine.memory_plan import DeviceMemory, MemoryPlan, default_max_num_seqs, working_bytes
from engine.memory_plan import plan as plan_memory
from engine.native.kv_cache import BlockAllocator, KVCache, KVCacheSpec, kv_bytes_per_token
from engine.native.model import ModelArgs, Transformer
from engine.native.model_runner import ModelRunner
from engine.native.sampler import QueuedLogprobs, prompt_logprobs, queue_logprobs, sample, skip_draws
from engine.native.scheduler import Scheduled, Scheduler, Sequence
from engine.request_stream import EngineThread, RequestStream, TokenEvent, TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.tokenizer import model_eos_ids
from engine.weights import LoadedWeights, WeightOrigin, WeightSource, weight_source

log = logging.getLogger("warmgate.engine")
STATS_INTERVAL = 10.0  # seconds between engine_stats log lines


class LLMEngine(EngineThread[Sequence]):
    """Load the model (blocking), then ``start()`` the scheduler thread and ``submit`` requests."""

    def __init__(self, config: EngineConfig, source: WeightSource | None = None) -> None:
        super().__init__()
        self.config = config
        self.startup_phases: dict[str, float] = {}
        self.stats = StepStats(self)
        self._masks: TokenMasks | None = None  # the grammars' token masks, one row per sequence sampled in a step
        self._masker: ThreadPoolExecutor | None = None  # fills them while the forward runs
        with self._phase("device_init"):
            self.device = resolve_device(config.device)
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
                torch.zeros(1, device=self.device)  # create the context now, not on the first request
            self.dtype = compute_dtype(self.device, config.dtype)
            if config.weights != "disk":
                preload_transport(self.device)  # the CUDA driver bindings: an import, not part of the attach
        with self._phase("weight_load"):
            source = source or weight_source(config.model, config.weights, config.cache_socket)
            loaded = source.load(self.device, self.dtype)
            self.weights: LoadedWeights = loaded  # holds the cache attachment (lease, mappings) while we live
            self.weight_source = loaded.source
        with self._phase("model_init"):  # the skeleton: binds the weights, builds rotary tables
            self.args = ModelArgs.from_config(loaded.config)
            self.model = Transformer(self.args, loaded.weights)
        self.eos_token_ids = model_eos_ids(loaded.config, config.model)
        with self._phase("kv_alloc"):
            planned = self._plan_memory(loaded)
            self.max_num_seqs, self.max_model_len = planned.max_num_seqs, planned.max_model_len
            spec = KVCacheSpec.plan(self.args.shape, self.dtype, self.max_num_seqs, self.max_model_len,
                                    planned.kv_cache_bytes, config.block_size)  # fmt: skip
            self.kv = KVCache(self.args.shape, spec, self.dtype, self.device)
        self.memory = {**planned.describe(), "kv_cache_bytes": spec.total_bytes, "kv_tokens": spec.usable_tokens}
        log_event(log, "memory_plan", **{k: v for k, v in self.memory.items() if k != "device"},
                  **(planned.device.describe() if planned.device else {}))  # fmt: skip
        allocator = BlockAllocator(spec, prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(allocator, self.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.kv, self.max_num_seqs, config.max_num_batched_tokens,
                                  self.max_model_len, config.cuda_graphs)  # fmt: skip
        if self.runner.use_graphs:
            with self._phase("cuda_graphs"):  # every graph before ready: no capture on a request's path
                self.runner.capture_all()
        with self._phase("warmup"):
            self.generate([[self.eos_token_ids[0]] * 4], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))

    def _plan_memory(self, loaded: LoadedWeights) -> MemoryPlan:
        """Sequences, longest sequence and KV cache budget (engine/memory_plan.py): from the device's memory on
        CUDA, from the settings alone on the CPU."""
        config, shape = self.config, self.args.shape
        device = None
        if self.device.type == "cuda":
            seqs = config.max_num_seqs or default_max_num_seqs("cuda")
            weights = sum(t.nbytes for t in loaded.weights.tensors.values() if t.device.type == "cuda")
            # What this process's allocator holds unused goes back first: its segments, left by an earlier engine
            # in the same process, are not one piece a KV cache of that size could be allocated from.
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            device = DeviceMemory(total=total, free=free, fraction=config.gpu_memory_fraction, weights=weights,
                                  shared_weights=loaded.source == "ipc",
                                  working=working_bytes(shape, config.max_num_batched_tokens, seqs),
                                  kv_share=config.kv_share)  # fmt: skip
        per_token = kv_bytes_per_token(shape, self.dtype)
        return plan_memory(self.args.max_position_embeddings, per_token, self.device.type, config.max_num_seqs,
                           config.max_model_len, config.kv_cache_bytes, device)  # fmt: skip

    def _phase(self, name: str) -> _Timer:
        return _Timer(self.startup_phases, name)

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               output_ids: list[int] | None = None) -> RequestStream:  # fmt: skip
        """Queue a request; must be called on the asyncio loop that will iterate the stream.

        ``output_ids``: tokens another engine already generated for this request (a resume). They are
        prefilled with the prompt and count towards max_tokens; a seeded sampler skips the draws they
        took, so it continues the sequence it would have drawn. Raises ValueError when the prompt is
        empty, prompt + max_tokens exceeds max_model_len, or the output already reached max_tokens.
        """
        self._check(prompt_ids, params)
        output = list(output_ids or [])
        if output and len(output) >= params.max_tokens:
            raise ValueError(f"the request already has {len(output)} of its {params.max_tokens} tokens")
        stream = RequestStream(request_id or uuid.uuid4().hex, len(prompt_ids), asyncio.get_running_loop(),
                               self._outbox)  # fmt: skip
        seq = self._sequence(stream.request_id, prompt_ids, params, stream.push)
        if params.grammar is not None:
            seq.grammar = GrammarState(params.grammar, output)  # a resume replays what was generated
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # the first prompt token: nothing predicts it
        if output:
            seq.output = output
            if seq.generator is not None and not params.greedy:
                skip_draws(seq.generator, len(output), self.args.shape.vocab, self.device)
        seq.is_cancelled = lambda: stream.cancelled
        self._enqueue(seq)
        return stream

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Synchronous batch generation (tests, benchmarks): all prompts scheduled together."""
        if self._running_thread():
            raise RuntimeError("generate() runs the scheduler itself; use submit() once start() was called")
        outputs: list[list[int]] = [[] for _ in prompts]
        for i, prompt in enumerate(prompts):
            self._check(prompt, params)
            self.scheduler.add(self._sequence(f"gen-{i}", prompt, params, lambda e, out=outputs[i]: _collect(out, e)))
        while not self.scheduler.idle:
            self._step()
        return outputs

    def device_memory_bytes(self) -> int:
        """Device memory this engine's allocator holds (KV cache, activations, graph pools); 0 on CPU."""
        return int(torch.cuda.memory_reserved(self.device)) if self.device.type == "cuda" else 0

    @property
    def weight_origin(self) -> WeightOrigin:
        return self.weights.origin

    @property
    def vocab_size(self) -> int:
        return self.args.shape.vocab

    @property
    def kv_blocks_free(self) -> int:
        return self.scheduler.allocator.free

    @property
    def kv_blocks_total(self) -> int:
        return self.kv.spec.blocks - 1  # block 0 is the padding block

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.preemptions

    @property
    def prefix_cache(self) -> tuple[int, int]:
        allocator = self.scheduler.allocator
        return allocator.queried_tokens, allocator.hit_tokens

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._inbox)

    # -- the scheduler thread (engine/request_stream.py's EngineThread) ---------------------

    def _idle(self) -> bool:
        return self.scheduler.idle

    def _steps_on(self) -> bool:
        return not self.scheduler.idle  # and _step hands the events over, at the latest before it returns

    def _work(self, pending: list[Sequence]) -> None:
        for seq in pending:
            self.scheduler.add(seq)
        self._step()
        self.stats.step_done()

    def _fail(self, error: str) -> None:
        for seq in [*self.scheduler.running]:
            self._finish(seq, TokenEvent(None, "error", error=error))

    def _abort_all(self) -> None:
        for seq in [*self._inbox, *self.scheduler.waiting, *self.scheduler.running]:
            seq.emit(TokenEvent(None, "abort"))
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()

    def _description(self) -> tuple[str, int, int]:
        return self.config.name, self.kv.spec.block_size, self.kv_blocks_total

    def _load(self) -> tuple[int, int, int, int, int]:
        return self.num_running, self.num_waiting, self.kv_blocks_total - self.kv_blocks_free, *self.prefix_cache

    @torch.inference_mode()
    def _step(self) -> None:
        for seq in [*self.scheduler.waiting, *self.scheduler.running]:
            if seq.is_cancelled():
                self._finish(seq, TokenEvent(None, "abort"))
        step = self.scheduler.schedule()
        if not step:
            self._outbox.flush()
            return
        self._publish()
        self.stats.step_begin(step)
        # Partial prompt chunks sample nothing, nor does a prompt only scored (max_tokens 0).
        rows: list[int] = []
        scoring: list[int] = []
        for i, work in enumerate(step):
            if work.samples and work.seq.params.max_tokens:
                rows.append(i)
            if _scores_prompt(work):
                scoring.append(i)
        masks = self._fill_masks(step, rows)  # while the forward runs
        queued: QueuedLogprobs | None = None

        def launched(logits: torch.Tensor) -> None:  # queued behind the forward, while it runs:
            nonlocal queued
            self._outbox.flush()  # the last step's events
            if masks is not None:  # what their grammars allow: the rest becomes -inf
                assert self._masks is not None
                self._masks.apply(logits, masks.result())
            queued = queue_logprobs(logits, [(i, step[i].seq.params) for i in rows])  # of greedy rows

        out = self.runner.run(step, frozenset(scoring), launched=launched)
        self.stats.device_time(out.device_seconds)
        for i, logits in out.all_logits.items():
            _collect_prompt_logprobs(step[i], logits)
        self.scheduler.computed(step)
        for work in step:
            if work.samples and not work.seq.params.max_tokens:  # a prompt scored, nothing generated
                self._finish(work.seq, TokenEvent(None, "length", prompt_logprobs=_prompt_logprobs(work.seq)))
        if rows:
            logits = out.logits if len(rows) == len(step) else out.logits[rows]
            argmax = None if masks is not None else [out.argmax[i] for i in rows]  # the graph's is of unmasked logits
            reported = queued.report() if queued is not None else None
            self._advance([step[i].seq for i in rows], logits, argmax,
                          [reported.get(i) for i in rows] if reported is not None else None)  # fmt: skip

    def _fill_masks(self, step: list[Scheduled], rows: list[int]) -> Future[list[int]] | None:
        """The token masks of the sampling rows whose sequences follow a grammar (row i of the bitmask for step[i]),
        filled in a helper thread while this one runs the step's forward: a mask depends only on the tokens
        sampled so far, which the helper accepts first (GrammarState.catch_up). The future gives the rows."""
        constrained = [i for i in rows if step[i].seq.grammar is not None]
        if not constrained:
            return None
        if self._masks is None:
            self._masks = TokenMasks(self.max_num_seqs, pinned=self.device.type == "cuda")
            self._masker = ThreadPoolExecutor(1, thread_name_prefix="warmgate-grammar")
        masks = self._masks

        def fill() -> list[int]:
            masks.fill([step[i].seq.grammar for i in constrained], constrained)  # type: ignore[misc]
            return constrained

        assert self._masker is not None
        return self._masker.submit(fill)

    def _advance(self, seqs: list[Sequence], logits: torch.Tensor, argmax: list[int] | None = None,
                 reported: list[TokenLogprobs | None] | None = None) -> None:  # fmt: skip
        params, outputs = [s.params for s in seqs], [s.output for s in seqs]
        sampled = sample(logits, params, outputs, [s.generator for s in seqs], argmax, reported)
        for seq, token, logprobs in zip(seqs, sampled.tokens, sampled.logprobs, strict=True):
            reason = None
            p = seq.params
            if seq.grammar is not None:
                refused = seq.grammar.refused  # found as its mask was filled: its last token broke the grammar
                if refused is not None:
                    self._finish(seq, TokenEvent(None, "error", error=f"token {refused} does not follow the grammar"))
                    continue
                seq.grammar.pending.append(token)  # accepted before its next mask is filled
            seq.output.append(token)
            if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
                reason = "stop"
            elif len(seq.output) >= p.max_tokens or seq.length >= self.max_model_len:
                reason = "length"
            event = TokenEvent(token, reason, logprobs=logprobs, prompt_logprobs=_prompt_logprobs(seq))
            if reason:
                self._finish(seq, event)
            else:
                seq.emit(event)

    def _finish(self, seq: Sequence, event: TokenEvent) -> None:
        self.scheduler.finish(seq)
        seq.emit(event)

    def _sequence(self, request_id: str, prompt: list[int], params: SamplingParams, emit: Any) -> Sequence:
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        return Sequence(request_id, list(prompt), params, emit, generator=generator)

    def _check(self, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})"
            )


class StepStats:
    """Throughput and step times, logged every STATS_INTERVAL seconds while the engine works (as vLLM does)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.queried = self.hit = 0  # the allocator's prefix-cache counters at the last engine_stats line
        # The last step's start and device time, and whether the step after it followed at once (work was left).
        self._last: tuple[float, float] | None = None
        self._follows = False
        self._reset(time.perf_counter())

    def _reset(self, now: float) -> None:
        self.since = now
        self.steps = self.prompt_tokens = self.generated = 0
        self.busy = self.longest = self.device = 0.0
        # Steps that followed one another at once: from one's start to the next one's, and the device's time in
        # them. What the device did not spend of it, the host did (scheduling, staging, sampling, waiting for the
        # GIL): the device's idle share.
        self.span = self.spanned_device = 0.0
        self._began: float | None = None

    def step_begin(self, step: list[Any]) -> None:
        self._began = now = time.perf_counter()
        if self._follows and self._last is not None:
            self.span += now - self._last[0]
            self.spanned_device += self._last[1]
        self._last = None
        self.steps += 1
        for work in step:
            if work.samples:
                self.generated += 1
            if work.start < len(work.seq.prompt):
                self.prompt_tokens += min(work.count, len(work.seq.prompt) - work.start)

    def device_time(self, seconds: float) -> None:
        """The device's time on the step begun last."""
        assert self._began is not None
        self.device += seconds
        self._last = (self._began, seconds)

    def step_done(self) -> None:
        if self._began is None:  # nothing was scheduled
            self._follows = False
            return
        now = time.perf_counter()
        took, self._began = now - self._began, None
        self._follows = not self.engine.scheduler.idle
        self.busy += took
        self.longest = max(self.longest, took)
        if now - self.since >= STATS_INTERVAL and self.steps:
            window = now - self.since
            scheduler, allocator = self.engine.scheduler, self.engine.scheduler.allocator
            total = self.engine.kv.spec.blocks - 1
            queried, hit = allocator.queried_tokens - self.queried, allocator.hit_tokens - self.hit
            self.queried, self.hit = allocator.queried_tokens, allocator.hit_tokens
            log_event(log, "engine_stats", prompt_tok_s=round(self.prompt_tokens / window),
                      gen_tok_s=round(self.generated / window), running=len(scheduler.running),
                      waiting=len(scheduler.waiting), kv_usage=1 - allocator.free / total,
                      prefix_hit_rate=round(hit / queried, 3) if queried else 0.0,
                      steps=self.steps, step_ms_mean=1e3 * self.busy / self.steps, step_ms_max=1e3 * self.longest,
                      device_ms_mean=1e3 * self.device / self.steps,
                      device_idle=round(1 - self.spanned_device / self.span, 3) if self.span else None,
                      busy=self.busy / window, preemptions=scheduler.preemptions)  # fmt: skip
            self._reset(now)


class _Timer:
    def __init__(self, phases: dict[str, float], name: str) -> None:
        self.phases, self.name = phases, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.phases[self.name] = time.perf_counter() - self.start
        log.info("event=startup phase=%s seconds=%.3f", self.name, self.phases[self.name])


def _scores_prompt(work: Any) -> bool:
    """The step computes prompt tokens of a sequence whose prompt logprobs are still being collected."""
    seq = work.seq
    return seq.prompt_logprobs is not None and work.start < len(seq.prompt)


def _collect_prompt_logprobs(work: Any, logits: torch.Tensor) -> None:
    """Row j of ``logits`` (the work's token at position start + j) predicts the prompt token at start + j + 1:
    its logprob, for the positions not collected yet (a preempted sequence computes its prompt again)."""
    seq = work.seq
    got = seq.prompt_logprobs
    lo, hi = max(0, len(got) - work.start - 1), min(work.count, len(seq.prompt) - work.start - 1)
    if hi > lo:
        got += prompt_logprobs(logits[lo:hi], seq.prompt[work.start + lo + 1 : work.start + hi + 1],
                               seq.params.prompt_logprobs or 0)  # fmt: skip


def _prompt_logprobs(seq: Sequence) -> tuple[Any, ...] | None:
    """The prompt's logprobs, once (on the sequence's first event)."""
    got, seq.prompt_logprobs = seq.prompt_logprobs, None
    return tuple(got) if got is not None else None


def _collect(out: list[int], event: TokenEvent) -> None:
    if event.token_id is not None:
        out.append(event.token_id)
