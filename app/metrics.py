"""Prometheus metrics of the gateway, named like vLLM's where they mean the same (``warmgate:`` prefix).

Relays count requests (they serve them); the supervisor counts engines, restarts and the cache. Every
process writes its values into the run dir's ``metrics/`` folder (prometheus-client's multiprocess mode:
one small mmap'd file per process and kind), and any relay's ``/metrics`` sums them: one endpoint, the same
names, however many relays. Gauges count only live processes (``livesum``): a relay that died takes its
in-flight and queued requests with it; its counters stay in the sums, as a client saw them.

A relay's /metrics also reports the gateway's load under vLLM's own names (``vllm:``), the ones a Kubernetes
inference router (the Gateway API Inference Extension's endpoint picker) reads from every pod to choose one:
requests queued (in the relays and in the engines), requests running, the KV cache in use, the KV block size.
The engines' figures come from their heartbeat files (common/heartbeat.py), read at the scrape.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from app.supervisor.engines import RestartReport

ENV = "PROMETHEUS_MULTIPROC_DIR"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60)
STATES = ("starting", "ready", "active", "standby", "draining", "stopped", "failed")
CONTENT_TYPE = CONTENT_TYPE_LATEST
QUEUED_IN_RELAYS = "warmgate:num_requests_waiting"
PREFIX_QUERIES, PREFIX_HITS = "warmgate:prefix_cache_queries", "warmgate:prefix_cache_hits"
NO_ADAPTERS = {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}


def use_directory(path: Path, *, fresh: bool = False) -> None:
    """Write this process's metrics into ``path`` (every process of one gateway uses the same folder), and its
    children's too (the variable is inherited). ``fresh``: empty it first (the supervisor, at start)."""
    if fresh and path.exists():
        shutil.rmtree(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.environ[ENV] = str(path)
    if "prometheus_client.values" in sys.modules:  # imported before the variable was set: switch it over
        from prometheus_client import values

        values.ValueClass = values.MultiProcessValue()


@dataclass(frozen=True)
class ServingLoad:
    """The gateway's engines as a router sees them: those that serve (the active one, and any draining), summed;
    the KV cache of the one that takes new requests (the active one; while none is, one that drains)."""

    running: int
    waiting: int  # in the engines' own queues (the relays' queue is in the multiprocess files)
    kv_usage: float  # 0..1
    block_size: int  # 0: no engine has served yet
    kv_blocks: int
    model_name: str


def render(serving: ServingLoad | None = None) -> bytes:
    """The exposition of every process's metrics in the folder (a relay's /metrics), and with ``serving`` the
    router's metrics (vLLM's names)."""
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    registry.register(_Exposition(multiprocess.MultiProcessCollector(None), serving))
    return bytes(generate_latest(registry))


class _Exposition(Collector):
    """The processes' metrics, then the router's, which add the relays' queue (read from those) to the engines'."""

    def __init__(self, processes: Collector, serving: ServingLoad | None) -> None:
        self.processes = processes
        self.serving = serving

    def collect(self) -> Iterator[Metric]:
        families = list(self.processes.collect())
        yield from families
        if self.serving is not None:

            def total(name: str) -> int:
                return int(sum(sample.value for f in families if f.name == name for sample in f.samples
                               if sample.name == name + ("_total" if f.type == "counter" else "")))  # fmt: skip

            yield from router_metrics(self.serving, total(QUEUED_IN_RELAYS), total(PREFIX_QUERIES),
                                      total(PREFIX_HITS))  # fmt: skip


def router_metrics(serving: ServingLoad, queued_in_relays: int, prefix_queries: int = 0,
                   prefix_hits: int = 0) -> list[Metric]:  # fmt: skip
    """The model-server protocol of the Gateway API Inference Extension, with the names vLLM gives these figures
    (and its endpoint picker reads by default); one series each, labelled with the model as vLLM's are."""
    model = {"model_name": serving.model_name}

    def gauge(name: str, documentation: str, value: float, labels: dict[str, str] = model) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, documentation, labels=list(labels))
        family.add_metric(list(labels.values()), value)
        return family

    waiting = queued_in_relays + serving.waiting
    families: list[Metric] = [
        gauge("vllm:num_requests_waiting", "Requests queued: in the relays and in the engines' schedulers", waiting),
        gauge("vllm:num_requests_running", "Sequences running in the engines (active, draining)", serving.running),
        gauge("vllm:kv_cache_usage_perc", "The active engine's KV-cache usage, 1 = 100 percent", serving.kv_usage),
        # No LoRA adapters: the picker reads this family by default, and skips a series that names none.
        gauge("vllm:lora_requests_info", "LoRA adapters (warmgate serves none)", 0, NO_ADAPTERS),
    ]
    if serving.block_size:
        layout = {"block_size": str(serving.block_size), "num_gpu_blocks": str(serving.kv_blocks)}
        families.append(gauge("vllm:cache_config_info", "The active engine's KV cache", 1, layout))
    for name, documentation, value in (
        ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix caches (all engines)", prefix_queries),
        ("vllm:prefix_cache_hits", "Prompt tokens taken from the prefix caches (all engines)", prefix_hits),
    ):
        counter = CounterMetricFamily(name, documentation, labels=list(model))
        counter.add_metric(list(model.values()), value)
        families.append(counter)
    return families


def forget_process(pid: int) -> None:
    """A process of the gateway exited: its gauges leave the sums (its counters stay)."""
    if ENV in os.environ:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)


class RelayMetrics:
    """What a relay counts: the requests it served, their latency and tokens, and those waiting for an engine."""

    def __init__(self) -> None:
        self.requests = Counter("warmgate:requests", "HTTP requests by route and status", ["route", "status"],
                                registry=None)  # fmt: skip
        self.latency = Histogram("warmgate:e2e_request_latency_seconds", "Request latency through the gateway",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=None)  # fmt: skip
        self.ttft = Histogram("warmgate:time_to_first_token_seconds", "Time to the first generated token",
                              ["route"], buckets=LATENCY_BUCKETS, registry=None)  # fmt: skip
        self.prompt_tokens = Counter("warmgate:prompt_tokens", "Prompt tokens processed", registry=None)
        self.generation_tokens = Counter("warmgate:generation_tokens", "Tokens generated", registry=None)
        self.in_flight = Gauge("warmgate:num_requests_running", "Requests being served by an engine",
                               multiprocess_mode="livesum", registry=None)  # fmt: skip
        self.queued = Gauge("warmgate:num_requests_waiting", "Requests waiting in the gateway for an engine slot",
                            multiprocess_mode="livesum", registry=None)  # fmt: skip
        self.queue_wait = Histogram("warmgate:queue_wait_seconds", "Time requests waited in the gateway for an "
                                    "engine slot", buckets=LATENCY_BUCKETS, registry=None)  # fmt: skip
        self.resumes = Counter("warmgate:request_resumes", "Requests resumed on another engine after theirs failed",
                               registry=None)  # fmt: skip
        self.resume_failures = Counter("warmgate:request_resume_failures",
                                       "Requests ended with an error: their engine failed after the last resume",
                                       registry=None)  # fmt: skip


class SupervisorMetrics:
    """What the supervisor counts: engines by state, restarts and their phases, weight loads, the cache, relays."""

    def __init__(self) -> None:
        self.engines = Gauge("warmgate:engines", "Engine workers by state", ["state"], multiprocess_mode="livesum",
                             registry=None)  # fmt: skip
        self.restarts = Counter("warmgate:engine_restarts", "Engine restarts by reason and outcome",
                                ["reason", "ok"], registry=None)  # fmt: skip
        self.restart_phase = Histogram("warmgate:restart_phase_seconds", "Restart phase durations", ["phase"],
                                       buckets=PHASE_BUCKETS, registry=None)  # fmt: skip
        self.attach = Histogram("warmgate:weight_attach_seconds", "Engine weight attach time (ipc)",
                                buckets=PHASE_BUCKETS, registry=None)  # fmt: skip
        self.weight_loads = Counter("warmgate:weight_loads", "Engine weight loads by source", ["source"],
                                    registry=None)  # fmt: skip
        self.crashes = Counter("warmgate:engine_crashes", "Engines that exited while serving", registry=None)
        self.hung = Counter("warmgate:engines_hung", "Engines killed because their heartbeat stopped", registry=None)
        self.cache_restarts = Counter("warmgate:cache_restarts", "Cache processes that exited and were restarted",
                                      registry=None)  # fmt: skip
        self.cache_bytes = Gauge("warmgate:cache_bytes", "Bytes of processed weights held by the cache",
                                 multiprocess_mode="livesum", registry=None)  # fmt: skip
        self.cache_leases = Gauge("warmgate:cache_leases", "Engines attached to the cache's weights",
                                  multiprocess_mode="livesum", registry=None)  # fmt: skip
        self.relay_restarts = Counter("warmgate:relay_restarts", "Relay workers that exited and were restarted",
                                      registry=None)  # fmt: skip
        self.prefix_queries = Counter(PREFIX_QUERIES, "Prompt tokens the engines looked up in their prefix caches",
                                      registry=None)  # fmt: skip
        self.prefix_hits = Counter(PREFIX_HITS, "Prompt tokens the engines took from their prefix caches",
                                   registry=None)  # fmt: skip
        self._prefix_seen: dict[int, tuple[int, int]] = {}  # engine id -> its counters when last read
        for state in STATES:
            self.engines.labels(state).set(0)

    def restart_done(self, report: RestartReport) -> None:
        self.restarts.labels(report.reason, str(report.ok).lower()).inc()
        for phase, seconds in report.phases.items():
            self.restart_phase.labels(phase).observe(seconds)
        if report.weight_source is not None:
            self.weight_loads.labels(report.weight_source).inc()
            if report.weight_source == "ipc" and "weight_load" in report.phases:
                self.attach.observe(report.phases["weight_load"])

    def prefix_cache(self, engine: int, queries: int, hits: int) -> None:
        """An engine's prefix-cache counters as its heartbeat file has them now: what they grew by since the last
        read is added to the gateway's (which grow across restarts, as a client's view of the pod)."""
        last_queries, last_hits = self._prefix_seen.get(engine, (0, 0))
        self.prefix_queries.inc(max(0, queries - last_queries))
        self.prefix_hits.inc(max(0, hits - last_hits))
        self._prefix_seen[engine] = (queries, hits)

    def forget_engine(self, engine: int) -> None:
        self._prefix_seen.pop(engine, None)

    def engine_states(self, states: list[str]) -> None:
        for state in STATES:
            self.engines.labels(state).set(states.count(state))

    def cache_stats(self, nbytes: int, leases: int) -> None:
        self.cache_bytes.set(nbytes)
        self.cache_leases.set(leases)
