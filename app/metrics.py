"""Prometheus metrics of the gateway, named like vLLM's where they mean the same (``warmgate:`` prefix)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from app.engines import RestartReport

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60)
STATES = ("starting", "ready", "active", "standby", "draining", "stopped", "failed")


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("warmgate:requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)  # fmt: skip
        self.latency = Histogram("warmgate:e2e_request_latency_seconds", "Request latency through the gateway",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.ttft = Histogram("warmgate:time_to_first_token_seconds", "Time to the first generated token",
                              ["route"], buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.prompt_tokens = Counter("warmgate:prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("warmgate:generation_tokens", "Tokens generated", registry=r)
        self.in_flight = Gauge("warmgate:num_requests_running", "Requests being served by an engine", registry=r)
        self.queued = Gauge("warmgate:num_requests_waiting", "Requests waiting for an engine", registry=r)
        self.resumes = Counter("warmgate:request_resumes", "Requests resumed on another engine after theirs failed",
                               registry=r)  # fmt: skip
        self.resume_failures = Counter("warmgate:request_resume_failures",
                                       "Requests ended with an error: their engine failed after the last resume",
                                       registry=r)  # fmt: skip
        self.engines = Gauge("warmgate:engines", "Engine workers by state", ["state"], registry=r)
        self.restarts = Counter("warmgate:engine_restarts", "Engine restarts by reason and outcome",
                                ["reason", "ok"], registry=r)  # fmt: skip
        self.restart_phase = Histogram("warmgate:restart_phase_seconds", "Restart phase durations", ["phase"],
                                       buckets=PHASE_BUCKETS, registry=r)  # fmt: skip
        self.attach = Histogram("warmgate:weight_attach_seconds", "Engine weight attach time (ipc)",
                                buckets=PHASE_BUCKETS, registry=r)  # fmt: skip
        self.weight_loads = Counter("warmgate:weight_loads", "Engine weight loads by source", ["source"],
                                    registry=r)  # fmt: skip
        self.crashes = Counter("warmgate:engine_crashes", "Engines that exited while serving", registry=r)
        self.cache_restarts = Counter("warmgate:cache_restarts", "Cache processes that exited and were restarted",
                                      registry=r)  # fmt: skip
        self.cache_bytes = Gauge("warmgate:cache_bytes", "Bytes of processed weights held by the cache",
                                 registry=r)  # fmt: skip
        self.cache_leases = Gauge("warmgate:cache_leases", "Engines attached to the cache's weights", registry=r)
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

    def engine_states(self, states: list[str]) -> None:
        for state in STATES:
            self.engines.labels(state).set(states.count(state))

    def cache_stats(self, nbytes: int, leases: int) -> None:
        self.cache_bytes.set(nbytes)
        self.cache_leases.set(leases)

    def engine_crashed(self) -> None:
        self.crashes.inc()
