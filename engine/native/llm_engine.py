"""The engine core: one model, a paged KV cache, and a scheduler thread doing continuous batching.

The HTTP server talks to it through ``submit`` (from its asyncio loop) and iterates the
returned RequestStream; everything blocking (model forward, sampling) runs on the
engine's own thread. A step's token events reach the loop in one hand-over, not one per token:
the thread that feeds the GPU does no text work and wakes the loop once per step.

Steps overlap on the host: while the device runs step N, the engine thread reads step N-1's tokens (ends
what they end, hands their events over), schedules and launches step N+1, and between the two queues step
N's sampling behind its forward. Step N+1's sequences take step N's tokens on the device (they are not on
the host yet), so the device goes from one step to the next without waiting for the host. A sequence whose
step-N token ends it (an end-of-sequence token, a stop token) has a row in step N+1 that is thrown away; a
sequence whose last token by its length is being drawn gets none. vLLM's v1 engine (async scheduling) and
SGLang (overlap scheduler) do the same.

Scheduled a step ahead, a request that arrives while the device runs step N would wait for N+2: N+1 was made as N
began. With ``late_scheduling`` (the default), when step N+1 has room, the engine thread hands step N-1's events over
and schedules N+1 shortly before N is expected to end instead (``LaunchClock``), taking in what arrived meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from cache.arena import preload_transport
from cache.processors.native import compute_dtype
from common.device import resolve_device, to_device
from common.events import log_event, log_warning
from common.heartbeat import ENGINE_THREAD
from engine.config import EngineConfig
from engine.grammar import GrammarState, TokenMasks
from engine.memory_plan import DeviceMemory, MemoryPlan, default_max_num_seqs, working_bytes
from engine.memory_plan import plan as plan_memory
from engine.native.deep_gemm import DeepGemm
from engine.native.kv_cache import (
    BlockAllocator,
    KVCache,
    KVCacheSpec,
    kv_block_bytes,
    kv_bytes_per_token,
    kv_cache_dtype,
)
from engine.native.kv_memory import FIRST_BYTES, block_multiple, granularity
from engine.native.model import ModelArgs, Transformer
from engine.native.model_runner import ModelRunner, StepOutput
from engine.native.sampler import Drawn, draw, prompt_logprobs, skip_draws
from engine.native.scheduler import Scheduled, Scheduler, Sequence
from engine.request_stream import EngineThread, RequestStream, Sink, TokenEvent
from engine.sampling_params import SamplingParams, check_request
from engine.tokenizer import model_eos_ids
from engine.weights import LoadedWeights, WeightOrigin, WeightSource, weight_source

log = logging.getLogger("warmgate.engine")
STATS_INTERVAL = 10.0  # seconds between engine_stats log lines
# Steps after an activation logged one by one (step_after_activation: a promotion's first tokens); benchmarks ask for
# more to see how a load's steps are made up.
TRACED_STEPS = int(os.environ.get("WARMGATE_TRACED_STEPS", "8"))


class LLMEngine(EngineThread[Sequence]):
    """Load the model (blocking), then ``start()`` the scheduler thread and ``submit`` requests."""

    def __init__(self, config: EngineConfig, source: WeightSource | None = None) -> None:
        super().__init__()
        self.config = config
        self.startup_phases: dict[str, float] = {}
        self.stats = StepStats(self)
        self.clock = LaunchClock()
        self._masks: TokenMasks | None = None  # the grammars' token masks, one row per sequence sampled in a step
        self._masker: ThreadPoolExecutor | None = None  # fills them while the next step is scheduled
        self._launched: _Launched | None = None  # the step on the device, its tokens not drawn yet
        self._drawn: _Launched | None = None  # the step before it: its tokens drawn, not read yet
        self._activations: list[tuple[Future[float], float]] = []  # asked for (activate), with their timeouts
        self._activated = False  # the KV cache's first stripes are committed
        self._grown: list[tuple[int, int]] = []  # blocks committed since in the background, not handed out yet
        self._committing = False  # the background commit of a reserved cache's stripes is under way
        self._starved = False  # the last step found nothing to do but wait for the blocks of a stripe on its way
        self._read_at = 0.0  # when the device ended the last step read, if the read waited for it (else 0)
        with self._phase("device_init"):
            self.device = resolve_device(config.device)
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
                torch.zeros(1, device=self.device)  # create the context now, not on the first request
            self.dtype = compute_dtype(self.device, config.dtype)
            self.kv_dtype = kv_cache_dtype(self.dtype, config.kv_cache_dtype)
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
            shape, reserve = self.args.shape, config.reserve_kv
            block_bytes = kv_block_bytes(shape, self.kv_dtype, config.block_size)
            multiple = block_multiple(block_bytes, granularity(self.device, reserve))
            spec = KVCacheSpec.plan(shape, self.kv_dtype, self.max_num_seqs, self.max_model_len,
                                    planned.kv_cache_bytes, config.block_size, multiple)  # fmt: skip
            headroom = planned.device.commit_headroom if planned.device else 0
            self.kv = KVCache(shape, spec, self.kv_dtype, self.device, reserve, multiple, headroom)
        self.memory = {**planned.describe(), "kv_cache_bytes": spec.total_bytes, "kv_tokens": spec.usable_tokens,
                       "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch.")}  # fmt: skip
        log_event(log, "memory_plan", **{k: v for k, v in self.memory.items() if k != "device"},
                  **(planned.device.describe() if planned.device else {}))  # fmt: skip
        allocator = BlockAllocator(spec, prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(allocator, self.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.kv, self.max_num_seqs, config.max_num_batched_tokens,
                                  self.max_model_len, config.cuda_graphs)  # fmt: skip
        if self.runner.use_graphs and self.device.type == "cuda":
            with self._phase("deep_gemm"):  # its kernels for the graphs' sizes, built before they are captured
                deep = DeepGemm.load(self.device)
                if deep is not None:
                    built = self.model.use_deep_gemm(deep, self.runner.decode_sizes + self.runner.mixed_sizes)
                    log_event(log, "deep_gemm", kernels=built)
        if self.runner.use_graphs:
            with self._phase("cuda_graphs"):  # every graph before ready: no capture on a request's path
                self.runner.capture_all()
            self.startup_phases.update({f"graph_{k}": v for k, v in self.runner.capture_parts.items()})
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
                                  kv_share=config.kv_share, engines=config.engines, reserved=config.reserve_kv,
                                  kv_first=FIRST_BYTES if config.reserve_kv else 0)  # fmt: skip
        per_token = kv_bytes_per_token(shape, self.kv_dtype)
        return plan_memory(self.args.max_position_embeddings, per_token, self.device.type, config.max_num_seqs,
                           config.max_model_len, config.kv_cache_bytes, device)  # fmt: skip

    def _phase(self, name: str) -> _Timer:
        return _Timer(self.startup_phases, name)

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               output_ids: list[int] | None = None, sink: Sink | None = None) -> RequestStream:  # fmt: skip
        """Queue a request; must be called on the asyncio loop that will iterate the stream, unless ``sink`` takes its
        events (engine/front.py's link, from its own thread).

        ``output_ids``: tokens another engine already generated for this request (a resume). They are
        prefilled with the prompt and count towards max_tokens; a seeded sampler skips the draws they
        took, so it continues the sequence it would have drawn. Raises ValueError when the prompt is
        empty, prompt + max_tokens exceeds max_model_len, or the output already reached max_tokens.
        """
        check_request(prompt_ids, params, self.max_model_len, output_ids)
        output = list(output_ids or [])
        loop = asyncio.get_running_loop() if sink is None else None
        stream = RequestStream(request_id or uuid.uuid4().hex, len(prompt_ids), loop, self._outbox, sink)
        seq = self._sequence(stream.request_id, prompt_ids, params, stream.push)
        if params.grammar is not None:
            seq.grammar = GrammarState(params.grammar, output)  # a resume replays what was generated
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
            check_request(prompt, params, self.max_model_len)
            self.scheduler.add(self._sequence(f"gen-{i}", prompt, params, lambda e, out=outputs[i]: _collect(out, e)))
        while self._stepping():
            self._step()
        return outputs

    def device_memory_bytes(self) -> int:
        """Device memory this engine holds through torch's allocator (activations, graph pools, a KV cache allocated
        at start) and in a committed reserved KV cache (engine/native/kv_memory.py); 0 on CPU."""
        if self.device.type != "cuda":
            return 0
        return int(torch.cuda.memory_reserved(self.device)) + self.kv.memory.device_bytes

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

    def activate(self, timeout: float) -> Future[float]:
        """Commit the KV cache's memory (a reserved cache, engine/native/kv_memory.py; else nothing to do), on the
        engine thread once no step is on the device; the future's result is the seconds the commit took. The
        supervisor asks before the engine takes traffic; until then only its warm-up and the supervisor's probe ran
        on the placeholder."""
        done: Future[float] = Future()
        with self._wake:
            self._activations.append((done, timeout))
            self._wake.notify()
        return done

    def _stepping(self) -> bool:
        return not (self.scheduler.idle and self._launched is None and self._drawn is None)

    def _idle(self) -> bool:
        waits = not self._stepping() or (self._starved and self.scheduler.allocator.incoming())
        return waits and not self._activations and not self._grown

    def _steps_on(self) -> bool:
        return self._stepping()  # and _step hands the events over, at the latest before it returns

    def _work(self, pending: list[Sequence]) -> None:
        if self._grown:
            with self._wake:
                grown, self._grown = self._grown, []
            for first, end in grown:
                self.scheduler.allocator.add(first, end)
        if self._activations and not self._stepping():
            self._activate()
        for seq in pending:
            self.scheduler.add(seq)
        if not self._stepping():
            return
        began = time.perf_counter()
        self._step()
        self.stats.step_done(time.perf_counter() - began)

    def _activate(self) -> None:
        """Commit the cache's first stripes (the rest follow in the background, engine/native/kv_memory.py), and
        hand the scheduler only committed blocks; the prefixes cached by what ran on the placeholder are gone."""
        with self._wake:
            activations, self._activations = self._activations, []
        memory, timeout = self.kv.memory, max(t for _, t in activations)
        beat = self._heartbeat.beat if self._heartbeat is not None else lambda _slot: None
        seconds, asked = 0.0, time.perf_counter()
        if not self._activated:
            reserved = not memory.committed
            try:
                seconds = memory.commit_first(timeout, lambda: beat(ENGINE_THREAD))
            except Exception as exc:
                for done, _ in activations:
                    done.set_exception(exc)
                return
            self._activated = True
            self.stats.trace(asked)
            if reserved:
                self.scheduler.allocator.forget_cached()
                self.scheduler.allocator.limit(memory.committed_blocks)
                self._committing = True
                self.scheduler.allocator.incoming = lambda: self._committing and not memory.short
                threading.Thread(target=self._commit_rest, args=(timeout,), name="warmgate-kv-commit",
                                 daemon=True).start()  # fmt: skip
        for done, _ in activations:
            done.set_result(seconds)

    def _commit_rest(self, timeout: float) -> None:
        """The background thread: the cache's other stripes, each handed to the engine thread once committed."""
        try:
            while (stripe := self.kv.memory.commit_next(timeout)) is not None:
                with self._wake:
                    self._grown.append(stripe)
                    self._wake.notify()
        except Exception as exc:  # the engine serves on with the blocks it has
            log_warning(log, "kv_commit_stopped", error=exc, blocks=self.kv.memory.committed_blocks)
        finally:
            with self._wake:
                self._committing = False  # no more blocks come: a sequence short of them evicts another again
                self._wake.notify()

    def _fail(self, error: str) -> None:
        self._launched = self._drawn = None  # what they drew is lost: a waiting sequence draws it again
        for seq in [*self.scheduler.running]:
            self._finish(seq, TokenEvent(None, "error", error=error))
        for seq in self.scheduler.waiting:
            seq.pending = 0

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
        """Read step N-1's tokens, (late scheduling) hand their events over and wait for arrivals until shortly
        before step N ends, fill step N's grammar masks, schedule step N+1, queue step N's sampling, launch step N+1,
        hand step N-1's events over; the device computes step N meanwhile."""
        for seq in [*self.scheduler.waiting, *self.scheduler.running]:
            if seq.is_cancelled():
                self._finish(seq, TokenEvent(None, "abort"))
        drawn, self._drawn = self._drawn, None
        if drawn is not None:
            self._complete(drawn)
        launched, self._launched = self._launched, None
        if launched is not None and self.runner.asynchronous and self.config.late_scheduling:
            # The device began step N when step N-1 ended (the read just now waited for it), or at its launch.
            self._hold(launched, max(launched.began, self._read_at if drawn is not None else 0.0))
        scheduling = time.perf_counter()
        masks = self._fill_masks(launched) if launched is not None else None  # beside the scheduling
        step = self.scheduler.schedule()
        if step:
            self._publish()
        if launched is not None:
            self._draw(launched, masks)
            self._drawn = launched
        if step:
            self._launched = self._launch(step, launched)
            self.clock.launched(time.perf_counter() - scheduling)
        # Nothing on the device and nothing to launch: the sequences wait for the blocks of a stripe on its way (the
        # loop sleeps until it lands, a request comes, or the next heartbeat), not in a busy loop of empty steps.
        self._starved = not step and launched is None and drawn is None
        self._outbox.flush()  # step N-1's events: the loop turns them into chunks while the device computes

    def _hold(self, running: _Launched, began: float) -> None:
        """Wait to schedule the next step until shortly before the device is expected to end ``running`` (began at
        ``began``), taking in the requests that arrive meanwhile, while the next step has room for them. Step N-1's
        events are handed over first; the wait ends early once the step is done or the next one is full."""
        deadline = self.clock.deadline(running.size, began)
        if deadline is None or deadline - time.perf_counter() < HOLD_MIN_S:
            return
        scheduler = self.scheduler
        seqs, tokens = scheduler.wanted()
        budget, limit = scheduler.max_batched_tokens, scheduler.max_num_seqs
        if seqs >= limit or tokens >= budget:
            return  # the next step is full already: nothing that arrives now would join it
        self._outbox.flush()
        timing, start = running.out.timing, time.perf_counter()
        while (left := deadline - time.perf_counter()) > 0 and seqs < limit and tokens < budget:
            with self._wake:
                if not self._inbox and not self._stopping:
                    self._wake.wait(left)  # a request's arrival wakes it
                pending, self._inbox = self._inbox, []
                stopping = self._stopping
            for seq in pending:
                scheduler.add(seq)
                seqs += 1
                tokens += scheduler.uncached(seq)
            if stopping or timing.done():
                break
        self.stats.hold(time.perf_counter() - start)

    def _launch(self, step: list[Scheduled], before: _Launched | None) -> _Launched:
        """Put the step on the device, its sequences' pending tokens taken from the step ``before``'s."""
        began = self.stats.step_begin(step)
        # Partial prompt chunks sample nothing, nor does a prompt only scored (max_tokens 0).
        rows = [i for i, work in enumerate(step) if work.samples and work.seq.params.max_tokens]
        scoring = frozenset(i for i, work in enumerate(step) if _scores_prompt(work))
        tokens = before.drawn.tokens if before is not None and before.drawn is not None else None
        out = self.runner.run(step, scoring, tokens)
        self.stats.staged(began, self.runner.shared)
        self.scheduler.computed(step)
        for row, i in enumerate(rows):
            seq = step[i].seq
            seq.pending += 1
            seq.pending_row = row
        return _Launched(step, rows, out, began, sum(work.count for work in step))

    def _fill_masks(self, launched: _Launched) -> Future[list[int]] | None:
        """The token masks of the step's sampling rows whose sequences follow a grammar (row i of the bitmask for
        step[i]), filled in a helper thread while this one schedules the next step: a mask depends only on the
        tokens sampled so far, which the helper accepts first (GrammarState.catch_up). The future gives the rows."""
        step = launched.step
        constrained = [i for i in launched.rows if step[i].seq.grammar is not None and not step[i].seq.finished]
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

    def _draw(self, launched: _Launched, masks: Future[list[int]] | None) -> None:
        """Queue the step's tokens (and logprobs) behind its forward: its sequences' outputs are known up to the
        step before, which is what penalties and grammars need."""
        step, rows, out = launched.step, launched.rows, launched.out
        if not rows:
            return
        logits = out.logits
        argmax: torch.Tensor | None = out.argmax
        if masks is not None:  # what their grammars allow: the rest becomes -inf
            assert self._masks is not None
            self._masks.apply(logits, masks.result())
            argmax = None  # the graph's is of unmasked logits
        if len(rows) < len(step):
            index = to_device(rows, logits.device)
            logits = logits.index_select(0, index)
            argmax = argmax.index_select(0, index) if argmax is not None else None
        seqs = [step[i].seq for i in rows]
        launched.drawn = draw(logits, [s.params for s in seqs], [s.output for s in seqs], [s.generator for s in seqs],
                              argmax)  # fmt: skip

    def _complete(self, landed: _Launched) -> None:
        """The step's tokens read: appended, checked against each request's ends, handed over as events."""
        step, out = landed.step, landed.out
        reading = time.perf_counter()
        sampled = landed.drawn.read() if landed.drawn is not None else None
        after = self._launched
        seconds = out.timing.seconds()
        # The device ended the step (and went on to the next) now if the read waited for it; if it did not, at some
        # time before: 0, so that the next step counts from its launch, its earliest start (LaunchClock, _hold).
        read = time.perf_counter()
        self._read_at = read if read - reading > READ_WAITED_S else 0.0
        self.stats.device_time(landed.began, seconds, after.began if after is not None else None)
        self.clock.ran(landed.size, seconds)
        for i, logits in out.all_logits.items():
            _collect_prompt_logprobs(step[i], logits)
        for work in step:
            seq = work.seq
            if work.samples and not seq.params.max_tokens and not seq.finished:  # a prompt scored, nothing generated
                self._finish(seq, TokenEvent(None, "length", prompt_logprobs=_prompt_logprobs(seq),
                                             cached_tokens=_cached_tokens(seq)))  # fmt: skip
        if sampled is None:
            return
        for i, token, logprobs in zip(landed.rows, sampled.tokens, sampled.logprobs, strict=True):
            seq = step[i].seq
            seq.pending -= 1
            if seq.finished:  # ended by the step before (this row was thrown away), cancelled, or failed
                continue
            reason = None
            p = seq.params
            if seq.grammar is not None:
                refused = seq.grammar.refused  # found as its mask was filled: its last token broke the grammar
                if refused is not None:
                    self._finish(seq, TokenEvent(None, "error", error=f"token {refused} does not follow the grammar"))
                    continue
                seq.grammar.pending.append(token)  # accepted before its next mask is filled
            seq.output.append(token)
            self.scheduler.remember(seq)  # a block its pending token filled
            if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
                reason = "stop"
            elif len(seq.output) >= p.max_tokens or seq.known >= self.max_model_len:
                reason = "length"
            event = TokenEvent(token, reason, logprobs=logprobs, prompt_logprobs=_prompt_logprobs(seq),
                               cached_tokens=_cached_tokens(seq))  # fmt: skip
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
        seq = Sequence(request_id, list(prompt), params, emit, generator=generator,
                       limit=min(len(prompt) + params.max_tokens, self.max_model_len))  # fmt: skip
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # the first prompt token: nothing predicts it
        return seq


class StepStats:
    """Throughput and step times, logged every STATS_INTERVAL seconds while the engine works (as vLLM does)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.queried = self.hit = 0  # the allocator's prefix-cache counters at the last engine_stats line
        self._activated_at: float | None = None  # the steps after it are logged one by one, TRACED_STEPS of them
        # launch time -> [tokens, prompt tokens, sequences, the shared prefix staged for attention]
        self._traced: dict[float, list[int]] = {}
        self._traces_left = 0
        self._held_in_step = 0.0
        self._reset(time.perf_counter())

    def trace(self, activated_at: float) -> None:
        """Log the next TRACED_STEPS steps one by one (launch and end after ``activated_at``, device time, size)."""
        self._activated_at, self._traces_left = activated_at, TRACED_STEPS

    def _reset(self, now: float) -> None:
        self.since = now
        self.steps = self.prompt_tokens = self.generated = self.holds = 0
        self.busy = self.longest = self.device = self.held = 0.0
        # Steps launched while the one before was still unread: from one's launch to the next one's, and the
        # device's time in them. What the device did not spend of it, it waited for the host (scheduling,
        # staging, sampling, the GIL): the device's idle share (none when the host keeps ahead: a step launched
        # while the one before still runs makes a span shorter than its device time).
        self.span = self.spanned_device = 0.0

    def step_begin(self, step: list[Any]) -> float:
        """A step is launched now (returned)."""
        self.steps += 1
        prompt = 0
        for work in step:
            if work.samples:
                self.generated += 1
            if work.start < len(work.seq.prompt):
                prompt += min(work.count, len(work.seq.prompt) - work.start)
        self.prompt_tokens += prompt
        began = time.perf_counter()
        if self._traces_left > len(self._traced):
            self._traced[began] = [sum(w.count for w in step), prompt, len(step), 0]
        return began

    def staged(self, began: float, shared: int) -> None:
        """The step launched at ``began`` told attention of a shared prefix of ``shared`` positions (0: none)."""
        if began in self._traced:
            self._traced[began][3] = shared

    def device_time(self, began: float, seconds: float, next_began: float | None) -> None:
        """The device's time on the step launched at ``began``, read once it is done; ``next_began``: when the step
        after it was launched, if one was before this one was read."""
        self.device += seconds
        if next_began is not None:
            self.span += next_began - began
            self.spanned_device += seconds
        size = self._traced.pop(began, None)
        if size is not None and self._activated_at is not None:
            self._traces_left -= 1
            since = self._activated_at
            # launched_at: the host's monotonic clock (perf_counter's on Linux), as the request lines' received_at
            log_event(log, "step_after_activation", launched_ms=1e3 * (began - since),
                      read_ms=1e3 * (time.perf_counter() - since), device_ms=1e3 * seconds, tokens=size[0],
                      prompt_tokens=size[1], seqs=size[2], shared=size[3], launched_at=f"{began:.4f}")  # fmt: skip

    def hold(self, seconds: float) -> None:
        """The engine thread waited ``seconds`` for arrivals before scheduling a step (``LLMEngine._hold``)."""
        self.holds += 1
        self.held += seconds
        self._held_in_step += seconds

    def step_done(self, took: float) -> None:
        """One turn of the engine thread (``_step``) took ``took`` seconds, its hold for arrivals included."""
        now = time.perf_counter()
        took, self._held_in_step = took - self._held_in_step, 0.0
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
                      device_idle=round(max(0.0, 1 - self.spanned_device / self.span), 3) if self.span else None,
                      busy=self.busy / window, holds=self.holds,
                      held_ms_mean=1e3 * self.held / self.holds if self.holds else 0.0,
                      preemptions=scheduler.preemptions)  # fmt: skip
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


def _cached_tokens(seq: Sequence) -> int:
    """Its prompt's tokens found cached at its admission, once (on the sequence's first event)."""
    got, seq.cached_tokens = seq.cached_tokens, 0
    return got or 0


@dataclass
class _Launched:
    """A step put on the device: its work, the indexes of the sequences it draws a token for (``rows``), its
    outputs, when it was launched; then its tokens, queued behind it (``LLMEngine._draw``)."""

    step: list[Scheduled]
    rows: list[int]
    out: StepOutput
    began: float
    size: int  # the tokens it computes, counted once: what the launch clock learns from and waits by
    drawn: Drawn | None = None


HOLD_MIN_S = 0.001  # a shorter wait for arrivals is not worth it
READ_WAITED_S = 0.0002  # a read of a step's tokens this long or longer waited for the device to end the step


class LaunchClock:
    """When to schedule the step after the one on the device (``LLMEngine._hold``): the device's least time on a
    recent step of as many tokens or a quarter fewer at most (a lower bound of this one's: fewer tokens replay the
    same graph or a smaller one, and its attention over longer contexts only adds), less the host's longest recent
    time from scheduling a step to its launch, and a safety margin. No such step yet: at once, as before."""

    STEPS = 64  # recent steps' device times kept
    FEWER = 0.25  # the steps it learns from: as many tokens as this one, or this share fewer
    MARGIN_S = 0.001  # the read's wake-up after the step's end, and the host's jitter past its longest recent launch

    def __init__(self) -> None:
        self.steps: deque[tuple[int, float]] = deque(maxlen=self.STEPS)  # (tokens, device seconds)
        self.host: deque[float] = deque(maxlen=16)  # seconds from scheduling a step to its launch's return

    def ran(self, tokens: int, seconds: float) -> None:
        self.steps.append((tokens, seconds))

    def launched(self, seconds: float) -> None:
        self.host.append(seconds)

    def deadline(self, tokens: int, began: float) -> float | None:
        """When to schedule the step after a step of ``tokens`` tokens that the device began at ``began``."""
        low = tokens * (1 - self.FEWER)
        least = min((s for t, s in self.steps if low <= t <= tokens), default=None)
        if least is None or not self.host:
            return None
        return began + least - max(self.host) - self.MARGIN_S


def _collect(out: list[int], event: TokenEvent) -> None:
    if event.token_id is not None:
        out.append(event.token_id)
