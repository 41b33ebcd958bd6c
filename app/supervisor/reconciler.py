"""The reconciler: the one loop that decides which engines run, as gunicorn's Arbiter decides which workers do.

Desired state: an active engine running config C, started or promoted for the latest restart request, and
``standby`` standbys running C. Everything that happens to engines arrives as an event on one queue: a
restart asked for, an engine started (or failed to), a promotion probe answered, a process exited, a
heartbeat stopped, a drain finished, a timer. The loop applies each event to the engines' states
(``engines.transition``; this loop is its only caller), compares what runs with what is wanted, and
starts the next small action as a task (start, probe, retire) that reports back with another event. No
action blocks the loop: a crash is handled while another engine starts, and nothing else writes state.

A restart request goes through these phases (``Phase``):

    pick      a standby running the requested config? probe it (a real 1-token generation)
    clear     ``replace``: drain and stop the old engine first, while requests wait in the relays
    obtain    no standby: start an engine (forked from the fork server, else spawned)
    activate  the new engine commits its KV cache (reserved until now: engine/native/kv_memory.py), in the memory
              the engine it replaces gave back (a crashed or replaced one) or left for it (``overlap``)
    switch    the new engine becomes active; the relays get the new table; ``overlap``: the old engine is
              drained once every relay has stopped sending it requests
    finish    the report is complete when the old engine has stopped; the next restart does not wait for it (its
              candidate's KV commit waits for memory a draining engine still holds, kv_memory.py)

A crash of the active engine leaves none active: the loop then carries out a restart of its own (reason
"crash", standby first), with backoff after failures. A new engine that fails to start is stopped and
reported; the old engine keeps serving (``overlap``), or the last good config comes back (``replace``).

Engines outlive the supervisor. A new one ``adopt``s those an earlier one left active and standing by (the run
dir's state.json, app/supervisor/state.py) before its loop starts: they keep their ids and serve on, untouched.
After every event the loop hands ``on_change`` the engines, for that file.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from app.config import RestartSettings
from app.metrics import SupervisorMetrics
from app.supervisor.engines import Engine, EngineStartError, EngineState, RestartReport, transition
from app.supervisor.launcher import Launcher
from app.supervisor.logs import remove_old_logs
from common.backoff import Backoff
from common.events import log_event, log_warning
from engine.config import EngineConfig

log = logging.getLogger("warmgate.supervisor.engines")
PROBE_TIMEOUT_S = 30.0  # a standby's promotion probe
ACTIVATE_WAIT_S = 15.0  # beyond drain_timeout: a retired engine's stop (10 s grace) and its context's teardown
KEEP_LOGS = 20  # engine logs kept in the run dir (the newest): one per engine ever started would grow forever


@dataclass(frozen=True)
class Routing:
    """Where requests go: what the relays' table is made of."""

    active: Engine | None
    standbys: tuple[Engine, ...]
    draining: tuple[Engine, ...]

    def key(self) -> tuple[Any, ...]:
        ids = lambda engines: tuple(e.id for e in engines)  # noqa: E731
        return (self.active.id if self.active else None, ids(self.standbys), ids(self.draining))


# -- events: everything that happens to engines ---------------------------------------------------------------


@dataclass(frozen=True)
class RestartRequest:
    """A change of desired state: the active engine must run ``config``, started (or promoted) for this request."""

    config: EngineConfig
    strategy: str
    reason: str
    done: asyncio.Future[RestartReport] | None = None
    at_switch: bool = False  # answer once the new engine takes traffic; the old one drains on in the background


@dataclass(frozen=True)
class Started:
    engine: Engine


@dataclass(frozen=True)
class StartFailed:
    engine: Engine
    error: str


@dataclass(frozen=True)
class Probed:
    engine: Engine
    error: str | None  # None: it answered


@dataclass(frozen=True)
class Activated:
    engine: Engine
    error: str | None  # None: its KV cache is committed


@dataclass(frozen=True)
class Exited:
    engine: Engine
    code: int | None  # None: its death seen before its exit (common/lifeline.py)


@dataclass(frozen=True)
class Hung:
    engine: Engine
    silent_s: float


@dataclass(frozen=True)
class Suspected:
    """A relay saw the engine fail a request."""

    engine: int
    why: str


@dataclass(frozen=True)
class Stopped:
    engine: Engine


@dataclass(frozen=True)
class Wake:
    """A timer ran out or the settings changed: look again."""


Event = RestartRequest | Started | StartFailed | Probed | Activated | Exited | Hung | Suspected | Stopped | Wake


class Phase(Enum):
    PICK = "pick"
    PROBING = "probing"
    CLEAR = "clear"
    DRAINING_OLD = "draining old"
    OBTAIN = "obtain"
    STARTING = "starting"
    ACTIVATING = "activating"
    SWITCH = "switch"
    FINISH = "finish"


@dataclass
class Restart:
    """A restart request being carried out."""

    request: RestartRequest
    report: RestartReport
    old: Engine | None  # the active engine when it began
    phase: Phase = Phase.PICK
    candidate: Engine | None = None  # the engine that will take over
    build: RestartReport | None = None  # the start's report of a standby build taken as the candidate
    launched: bool = False  # the restart started an engine of its own (fork or spawn), not a standby
    began: float = field(default_factory=time.perf_counter)
    mark: float = field(default_factory=time.perf_counter)  # when the current phase began

    def lap(self) -> float:
        now = time.perf_counter()
        seconds, self.mark = now - self.mark, now
        return seconds


class Reconciler:
    def __init__(self, run_dir: Path, limits: RestartSettings, launcher: Launcher, metrics: SupervisorMetrics,
                 on_routing: Callable[[Routing], Awaitable[None]], generation: int = 1,
                 on_change: Callable[[], None] | None = None) -> None:  # fmt: skip
        self.run_dir = run_dir
        self.generation = generation  # the gateway's (app/supervisor/run_dir.py): in engine file names
        self.limits = limits
        self.launcher = launcher
        self.metrics = metrics
        self.on_routing = on_routing  # publishes the routing; resolves once the relays have it
        self.on_change = on_change  # after every event: the engines may have changed (the run dir's state)
        self.engines: dict[int, Engine] = {}
        self.desired: EngineConfig | None = None  # the config the last good restart switched to
        self.reports: deque[RestartReport] = deque(maxlen=20)
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._requests: deque[RestartRequest] = deque()
        self._restart: Restart | None = None
        self._drains: dict[Engine, Restart] = {}  # switched restarts whose old engine still drains: their reports
        self._building: dict[Engine, RestartReport] = {}  # standbys being started, side by side, with their reports
        self._cancelled: set[Engine] = set()  # builds stopped as no longer wanted, their starts not yet failed
        self._lost = "crash"  # why no engine is active, when none is: the reason of the recovery's report
        self._recovery = Backoff(limits.crash_backoff, limits.crash_backoff_max)
        self._standby_backoff = Backoff(limits.crash_backoff, limits.crash_backoff_max)
        self._routing_key: tuple[Any, ...] | None = None
        self._routed: asyncio.Future[None] | None = None  # the relays have the latest routing
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._closing = False

    # -- what runs, read off the states -------------------------------------------------------------------

    @property
    def active(self) -> Engine | None:
        return next((e for e in self.engines.values() if e.state is EngineState.ACTIVE), None)

    def standbys(self) -> list[Engine]:
        """Standbys free for the next restart (the one being probed for a restart is not)."""
        candidate = self._restart.candidate if self._restart is not None else None
        return [e for e in self.engines.values() if e.state is EngineState.STANDBY and e is not candidate]

    def routing(self) -> Routing:
        engines = self.engines.values()
        return Routing(self.active, tuple(e for e in engines if e.state is EngineState.STANDBY),
                       tuple(e for e in engines if e.state is EngineState.DRAINING))  # fmt: skip

    # -- what the supervisor asks ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._loop())
            # A first look with no event: adopted engines may lack a standby (an earlier supervisor died while one
            # was starting, and it was stopped), and nothing else would make the loop start one.
            self.post(Wake())

    def adopt(self, engines: list[tuple[Engine, EngineState]]) -> None:
        """Take over engines an earlier supervisor left running, each in its state (ACTIVE or STANDBY), before the
        loop starts: watched from now on, ids kept (the relays count requests by engine id), no restart. The
        active one's config is the desired config."""
        for engine, state in engines:
            self.engines[engine.id] = engine
            self._set(engine, EngineState.READY)
            self._set(engine, state)
            self._spawn(self._watch(engine))
            if state is EngineState.ACTIVE:
                self.desired = engine.config
        self._ids = itertools.count(max((e.id for e, _ in engines), default=0) + 1)
        self._routing_key = self.routing().key()  # the relays serve with this routing already

    async def restart(self, config: EngineConfig | None, strategy: str, reason: str,
                      at_switch: bool = False) -> RestartReport:  # fmt: skip
        """Want an active engine started (or promoted) for this request with ``config`` (none: the current one).
        The report comes once the old engine has drained, or with ``at_switch`` once the new one takes traffic
        (``drained`` false: the old one drains on, shown as draining in the status). Either way the next restart
        begins at the switch: back-to-back restarts do not queue behind drains."""
        wanted = config or self.desired
        if wanted is None:
            raise ValueError("no engine config yet: the first engine has not started")
        done: asyncio.Future[RestartReport] = asyncio.get_running_loop().create_future()
        self.post(RestartRequest(wanted, strategy, reason, done, at_switch))
        return await done

    def post(self, event: Event) -> None:
        """Hand an event to the loop (from any task of the supervisor's event loop)."""
        self._events.put_nowait(event)

    def configure(self, limits: RestartSettings) -> None:
        """New [restart] settings (a reload): from the next use on; the loop starts or retires standbys to match."""
        self.limits = limits
        self._recovery.configure(limits.crash_backoff, limits.crash_backoff_max)
        self._standby_backoff.configure(limits.crash_backoff, limits.crash_backoff_max)
        self.post(Wake())

    async def close(self, stop_engines: bool = True) -> None:
        """Stop the loop and its tasks, and (``stop_engines``) every engine; without, they serve on for the next
        supervisor to adopt."""
        self._closing = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for request in self._requests:
            if request.done is not None:
                request.done.cancel()
        for r in [self._restart, *self._drains.values()]:
            if r is not None and r.request.done is not None:
                r.request.done.cancel()
        if not stop_engines:
            return
        grace = self.limits.drain_timeout + 10
        await asyncio.gather(*(self.launcher.stop(e, grace) for e in list(self.engines.values())),
                             return_exceptions=True)  # fmt: skip
        self.engines.clear()

    def status(self) -> dict[str, Any]:
        active = self.active
        return {
            "active": active.id if active else None,
            "standbys": [e.id for e in self.standbys()],
            "engines": [e.describe() for e in self.engines.values()],
            "restarts": [r.to_json() for r in self.reports],
        }

    # -- the loop -------------------------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            event = await self._events.get()
            try:
                self._apply(event)
                self._reconcile()
            except Exception:  # the loop must outlive any one failure (a bug); its requests get a failed report
                log.exception("event=reconcile_failed")
                if self._restart is not None:
                    self._fail(self._restart, "internal error in the reconciler (see the log)")
            self._publish()
            self.metrics.engine_states([e.state.value for e in self.engines.values()])
            if self.on_change is not None:
                self.on_change()

    def _apply(self, event: Event) -> None:
        r = self._restart
        if isinstance(event, RestartRequest):
            self._requests.append(event)
        elif isinstance(event, Started):
            self._started(event.engine)
        elif isinstance(event, StartFailed):
            self._start_failed(event.engine, event.error)
        elif isinstance(event, Probed):
            self._answered(r, event.engine, event.error, Phase.PROBING, "probe", Phase.CLEAR)
        elif isinstance(event, Activated):
            self._answered(r, event.engine, event.error, Phase.ACTIVATING, "activate", Phase.SWITCH)
        elif isinstance(event, Exited):
            self._exited(event.engine, event.code)
        elif isinstance(event, Hung):
            engine = event.engine
            if engine.state in (EngineState.ACTIVE, EngineState.STANDBY) and engine.process is not None:
                log_warning(log, "engine_hung", engine=engine.id, pid=engine.pid,
                          silent_s=event.silent_s)  # fmt: skip
                self.metrics.hung.inc()
                with contextlib.suppress(ProcessLookupError):
                    engine.process.kill()  # its Exited event follows: handled as a crash
        elif isinstance(event, Suspected):
            # Nothing to decide here: an engine that exited is reported by its watcher, one that stopped making
            # progress by its heartbeat; one that does neither failed one connection and serves on.
            if event.engine in self.engines:
                log_event(log, "engine_suspected", engine=event.engine, why=event.why)
        elif isinstance(event, Stopped):
            self._stopped(event.engine)

    def _answered(self, r: Restart | None, engine: Engine, error: str | None, waiting: Phase, name: str,
                  then: Phase) -> None:  # fmt: skip
        """The candidate's probe or activation (``name``) answered: on to ``then``; or the candidate is dropped, and
        a standby's place is taken by another standby or a new engine, while a new engine's restart fails."""
        if r is None or r.candidate is not engine or r.phase is not waiting:
            return  # it exited meanwhile: the restart has moved on
        r.report.phases[name] = r.lap()
        if error is None:
            r.phase = then
            return
        log_warning(log, "candidate_refused", engine=engine.id, path=r.report.path, by=name, error=error)
        self._fail_engine(engine)
        r.candidate = None
        if r.report.path == "standby":
            r.report.path, r.phase = None, Phase.PICK
        else:
            self._fail(r, error)

    def _reconcile(self) -> None:
        if self._closing:
            return
        while True:  # a restart done at its switch makes way for the next at once
            if self._restart is None:
                if self._requests:
                    request = self._requests.popleft()
                    self._restart = Restart(request, RestartReport(request.reason, request.strategy), self.active)
                elif self.active is None and self.desired is not None:
                    wait = self._recovery.remaining()
                    if wait > 0:
                        self._wake_in(wait)
                        break
                    recovery = RestartRequest(self.desired, "replace", self._lost)
                    self._restart = Restart(recovery, RestartReport(recovery.reason, recovery.strategy), None)
                else:
                    break
            r = self._restart
            self._advance(r)
            if self._restart is r:  # it waits for an event
                break
        under_way = self._restart
        self._stop_unwanted_builds(under_way.request.config if under_way is not None else self.desired)
        # During a restart too (it may be taking the standby a later one needs), but not while it starts an engine
        # of its own: builds beside that start slow it (on the H200 under load, the fork path's device_init took
        # 0.7-1.0 s beside two builds, 0.36-0.43 s without), and a standby is then built after its switch.
        if under_way is None or (under_way.request.config == self.desired and not under_way.launched):
            self._reconcile_standbys()

    def _advance(self, r: Restart) -> None:
        """Take the restart through as many phases as it can go without waiting for an event."""
        while True:
            if r.phase is Phase.PICK:
                standby = next((e for e in self.standbys() if e.config == r.request.config), None)
                if standby is not None:
                    r.candidate, r.report.path, r.phase = standby, "standby", Phase.PROBING
                    r.lap()
                    self._spawn(self._probe(standby))
                    return
                r.phase = Phase.CLEAR
            elif r.phase is Phase.CLEAR:
                old = r.old
                if r.request.strategy == "replace" and old is not None and old.state is EngineState.ACTIVE:
                    r.lap()
                    self._retire(old)
                    r.phase = Phase.DRAINING_OLD
                    return
                r.phase = Phase.OBTAIN
            elif r.phase is Phase.OBTAIN:
                if r.candidate is None:
                    # A standby of this config still starting began before any engine launched now would: the
                    # restart takes it (back-to-back restarts and crashes outrun the standbys' builds otherwise).
                    building = next((e for e in self._building if e.config == r.request.config), None)
                    if building is not None:
                        r.build = self._building.pop(building)
                        r.candidate, r.report.path = building, "standby"
                        r.lap()
                    else:
                        r.candidate, r.launched = self._launch(r.request.config, r.report), True
                    r.phase = Phase.STARTING
                    return
                self._activate(r)
                return
            elif r.phase is Phase.SWITCH:
                self._switch(r)
                return
            else:  # PROBING, DRAINING_OLD, STARTING, FINISH: waiting for an event
                return

    def _switch(self, r: Restart) -> None:
        engine = r.candidate
        assert engine is not None
        r.lap()
        old = self.active
        self._set(engine, EngineState.ACTIVE)
        if old is not None and old is not engine:
            self._retire(old)  # `overlap`: the old one drains once the relays have the new table
        r.old = old
        self._publish()
        report = r.report
        report.phases["switch"] = r.lap()
        report.switched_at, report.ok, report.engine = time.time(), True, engine.id
        report.weight_source = engine.health.weights.source if engine.health is not None else None
        report.path = report.path or engine.path
        self.desired = r.request.config
        self._recovery.succeeded()
        if old is not None and old is not engine:
            r.phase = Phase.FINISH
            report.drained = False
            self.reports.append(report)  # listed from the switch on; the drain's phase is added when it ends
            if r.request.at_switch and r.request.done is not None and not r.request.done.done():
                answer = dataclasses.replace(report, phases={**report.phases, "total": time.perf_counter() - r.began})
                r.request.done.set_result(answer)
            self._drains[old] = r  # completed when it has stopped (_stopped); the loop takes the next restart now
            self._restart = None
        else:
            self._complete(r)

    def _complete(self, r: Restart) -> None:
        report = r.report
        report.phases["total"] = time.perf_counter() - r.began
        if report.drained is False:  # listed at the switch
            report.drained = True
        else:
            self.reports.append(report)
        self.metrics.restart_done(report)
        (log_event if report.ok else log_warning)(log, "restart", reason=report.reason,
                  strategy=report.strategy, ok=report.ok, engine=report.engine, weight_source=report.weight_source,
                  path=report.path, error=report.error,
                  **{f"{k}_s": v for k, v in report.phases.items()})  # fmt: skip
        if r.request.done is not None and not r.request.done.done():
            r.request.done.set_result(report)
        if self._restart is r:
            self._restart = None
        if not report.ok and self.active is None:  # nothing serves: try again later, slower each time
            self._lost = "replace failed" if r.request.strategy == "replace" and r.old is not None else self._lost
            self._wake_in(self._recovery.failed())

    def _fail(self, r: Restart, error: str) -> None:
        r.report.error = error
        r.report.ok = False
        self._complete(r)

    # -- events ---------------------------------------------------------------------------------------------

    def _started(self, engine: Engine) -> None:
        self._building.pop(engine, None)
        stopped = engine in self._cancelled  # stopped as its start ended (_stop_unwanted_builds): retired below
        self._cancelled.discard(engine)
        if engine.state is not EngineState.STARTING:  # closed meanwhile
            return
        self._set(engine, EngineState.READY)
        self._spawn(self._watch(engine))
        r = self._restart
        if r is not None and r.candidate is engine:
            if r.report.path == "standby":  # a standby build the restart took while it started: its start's phases
                r.report.phases.update({**(r.build.phases if r.build else {}), "standby_wait": r.lap()})
            self._activate(r)
            return
        # a standby build (or a restart's candidate it no longer wants): kept if it is still wanted
        self._standby_backoff.succeeded()
        current = [e for e in self.standbys() if e.config == self.desired]
        if self._closing or stopped or engine.config != self.desired or len(current) >= self.limits.standbys:
            self._retire(engine)  # (a stopped build's config may still be the desired one: a restart stopped it)
            return
        self._set(engine, EngineState.STANDBY)
        log_event(log, "standby_ready", engine=engine.id, path=engine.path)

    def _start_failed(self, engine: Engine, error: str) -> None:
        self._forget(engine, EngineState.FAILED)
        if engine in self._cancelled:  # a build stopped on purpose (_stop_unwanted_builds)
            self._cancelled.discard(engine)
            return
        r = self._restart
        if r is not None and r.candidate is engine:
            r.candidate = None
            self._fail(r, error)
            return
        if self._building.pop(engine, None) is not None:
            log_warning(log, "standby_failed", error=error)
            self._wake_in(self._standby_backoff.failed())

    def _exited(self, engine: Engine, code: int | None) -> None:
        if engine.state not in (EngineState.READY, EngineState.ACTIVE, EngineState.STANDBY):
            return  # starting (its start reports it), draining or stopped (retired on purpose)
        was_active = engine.state is EngineState.ACTIVE
        self._fail_engine(engine)
        log_warning(log, "engine_crashed", engine=engine.id, pid=engine.pid, code=code,
                  active=was_active)  # fmt: skip
        self.metrics.crashes.inc()
        if was_active:
            self._lost = "crash"
        r = self._restart
        if r is None:
            return
        if r.candidate is engine:  # the engine meant to take over is gone: find another
            r.candidate, r.report.path, r.phase = None, None, Phase.PICK
        if r.old is engine:
            r.old = None
            if r.phase is Phase.DRAINING_OLD:
                r.phase = Phase.OBTAIN

    def _stopped(self, engine: Engine) -> None:
        if engine.state is EngineState.DRAINING:
            self._forget(engine, EngineState.STOPPED)
        r = self._restart
        if r is not None and r.old is engine and r.phase is Phase.DRAINING_OLD:
            r.report.phases["drain"] = r.lap()
            r.phase = Phase.OBTAIN
        switched = self._drains.pop(engine, None)
        if switched is not None:  # `overlap`: the engine a switched restart replaced has drained
            switched.report.phases["drain"] = switched.lap()
            self._complete(switched)

    # -- primitives: each starts a task that reports back with an event ---------------------------------------

    def _launch(self, config: EngineConfig, report: RestartReport) -> Engine:
        engine_id = next(self._ids)
        # Named by generation and id: an earlier gateway's engine still draining in the run dir never shares a name.
        name = self.run_dir / f"engine-{self.generation}-{engine_id}"
        engine = Engine(engine_id, name.with_suffix(".sock"), name.with_suffix(".log"), name.with_suffix(".beat"),
                        config)  # fmt: skip
        remove_old_logs(self.run_dir, "engine-*.log", KEEP_LOGS)
        self.engines[engine_id] = engine
        self._spawn(self._start(engine, report))
        return engine

    async def _start(self, engine: Engine, report: RestartReport) -> None:
        try:
            await self.launcher.start(engine, report, self.limits.start_timeout)
        except EngineStartError as exc:
            self.post(StartFailed(engine, str(exc)))
        else:
            self.post(Started(engine))

    async def _probe(self, engine: Engine) -> None:
        try:
            await self.launcher.probe(engine, min(self.limits.start_timeout, PROBE_TIMEOUT_S))
        except Exception as exc:  # any failure of the probe refuses the standby
            self.post(Probed(engine, f"{type(exc).__name__}: {exc}"))
        else:
            self.post(Probed(engine, None))

    def _activate(self, r: Restart) -> None:
        engine = r.candidate
        assert engine is not None
        r.lap()
        r.phase = Phase.ACTIVATING
        # The memory it commits may still be held by the engine it replaces: a draining one gives it back when it
        # exits (within its drain and stop), a crashed one once the driver has torn its context down.
        timeout = self.limits.drain_timeout + ACTIVATE_WAIT_S

        async def activate() -> None:
            try:
                await self.launcher.activate(engine, timeout)
            except EngineStartError as exc:
                self.post(Activated(engine, str(exc)))
            else:
                self.post(Activated(engine, None))

        self._spawn(activate())

    def _retire(self, engine: Engine) -> None:
        """Take the engine out of routing now; drain and stop it once the relays have the table without it."""
        self._set(engine, EngineState.DRAINING)
        self._publish()
        routed = self._routed

        async def retire() -> None:
            if routed is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(routed)
            await self.launcher.retire(engine, self.limits.drain_timeout)
            self.post(Stopped(engine))

        self._spawn(retire())

    def _set(self, engine: Engine, state: EngineState) -> None:
        """The engine's new state, and the engine told of it (its process title says it)."""
        transition(engine, state)
        self.launcher.announce(engine)

    def _fail_engine(self, engine: Engine) -> None:
        """A running engine that must go (crashed, hung, refused its probe): out of routing now, stopped."""
        self._forget(engine, EngineState.FAILED)
        self._spawn(self.launcher.stop(engine, grace=5))

    def _forget(self, engine: Engine, final: EngineState) -> None:
        if engine.state is not final:
            transition(engine, final)
        self.engines.pop(engine.id, None)

    async def _watch(self, engine: Engine) -> None:
        """Notice a crash at once: the engine's lifeline cut, or its process's exit."""
        self.post(Exited(engine, await self.launcher.gone(engine)))

    def _stop_unwanted_builds(self, config: EngineConfig | None) -> None:
        """Stop the standby builds of a config other than ``config`` (the one a restart under way switches to, else
        the desired one): they could serve no restart, and each slows the starts beside it."""
        for engine in [e for e in self._building if e.config != config]:
            self._building.pop(engine)
            self._cancelled.add(engine)
            log_event(log, "standby_build_stopped", engine=engine.id)
            self._spawn(self.launcher.stop(engine, grace=0))

    def _reconcile_standbys(self) -> None:
        """Retire standbys of another config or beyond the wanted number; start one when one is missing."""
        if self._closing or self.desired is None or self.active is None:
            return
        standbys = self.standbys()
        current = [e for e in standbys if e.config == self.desired]
        for stale in [e for e in standbys if e.config != self.desired] + current[self.limits.standbys :]:
            self._retire(stale)
        missing = self.limits.standbys - len(current) - len(self._building)
        if missing <= 0:
            return
        wait = self._standby_backoff.remaining()
        if wait > 0:
            self._wake_in(wait)
            return
        for _ in range(missing):  # side by side: back-to-back restarts used them up faster than one at a time
            report = RestartReport(reason="standby", strategy="standby")
            self._building[self._launch(self.desired, report)] = report

    # -- plumbing ---------------------------------------------------------------------------------------------

    def _publish(self) -> None:
        """Tell the relays, if where requests go has changed."""
        routing = self.routing()
        key = routing.key()
        if key != self._routing_key:
            self._routing_key = key
            self._routed = asyncio.ensure_future(self.on_routing(routing))

    def _spawn(self, work: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _wake_in(self, seconds: float) -> None:
        asyncio.get_running_loop().call_later(max(seconds, 0.0), self.post, Wake())
