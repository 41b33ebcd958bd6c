"""The engine reconciler (app/supervisor/reconciler.py) driven with fake workers.

The worker processes and the launcher are fakes (mocks where a real engine would take seconds to start on this
machine; tests/test_gateway.py, tests/test_standby.py and tests/fault run the real ones): a fake engine starts,
fails, crashes or stalls exactly when a test says so, which the orderings below need. Everything else is the
real reconciler: its event loop, state machine, restart phases, standbys, backoff and routing.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from app.config import RestartSettings
from app.metrics import SupervisorMetrics
from app.supervisor.engines import Engine, EngineStartError, EngineState, IllegalTransition, RestartReport, transition
from app.supervisor.reconciler import Exited, Hung, Reconciler, Routing
from engine.config import EngineConfig
from engine.protocol import HealthResponse

pytestmark = pytest.mark.anyio
_pids = itertools.count(1000)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class FakeProcess:
    """A worker process that exits when told (signal, kill, or a test's crash())."""

    def __init__(self) -> None:
        self.pid = next(_pids)
        self.returncode: int | None = None
        self._exited = asyncio.Event()

    def exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._exited.set()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.exit(-sig)

    def kill(self) -> None:
        self.exit(-signal.SIGKILL)


class FakeLauncher:
    """Starts engines at once (or fails, or waits for a go), records what was done, in order."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.fail_starts: set[int] = set()  # engine ids whose start fails
        self.refuse_probe: set[int] = set()
        self.refuse_activation: set[int] = set()  # engine ids whose KV cache cannot be committed
        self.hold: dict[int, asyncio.Event] = {}  # engine id -> start waits for this
        self.ready_anyway: set[int] = set()  # engine ids whose start, once released, succeeds though stopped meanwhile
        self.draining = asyncio.Event()  # cleared: retired engines drain until it is set
        self.draining.set()

    async def start(self, engine: Engine, report: RestartReport, timeout: float) -> None:
        self.log.append(("start", engine.id))
        engine.process, engine.path = FakeProcess(), "fork"
        if engine.id in self.ready_anyway:  # as a real start that read the engine's ready line as the stop came
            await self.hold[engine.id].wait()
        elif engine.id in self.hold:  # until released, or stopped meanwhile
            waits = {asyncio.ensure_future(self.hold[engine.id].wait()), asyncio.ensure_future(engine.process.wait())}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            if engine.process.returncode is not None:
                raise EngineStartError(f"engine {engine.id} exited with {engine.process.returncode} during start-up")
        if engine.id in self.fail_starts:
            engine.process.exit(1)
            raise EngineStartError(f"engine {engine.id} exited with 1 during start-up")
        engine.health = HealthResponse.model_validate({"status": "ok", "running": 0, "waiting": 0, "in_flight": 0,
                                                       "weights": {"source": "ipc"}, "startup_phases": {}})  # fmt: skip
        report.phases["init"] = 0.001

    async def probe(self, engine: Engine, timeout: float) -> None:
        self.log.append(("probe", engine.id))
        if engine.id in self.refuse_probe:
            raise EngineStartError("probe answered 500")

    async def activate(self, engine: Engine, timeout: float) -> None:
        self.log.append(("activate", engine.id))
        if engine.id in self.refuse_activation:
            raise EngineStartError("activation answered 503: the KV cache needs 50.0 GB of device memory")

    async def retire(self, engine: Engine, drain_timeout: float) -> None:
        self.log.append(("retire", engine.id))
        await self.draining.wait()
        await self.stop(engine, 1)

    async def stop(self, engine: Engine, grace: float) -> None:
        if engine.process is not None:
            engine.process.send_signal(signal.SIGTERM)

    async def health(self, engine: Engine, timeout: float) -> HealthResponse | None:
        return engine.health

    async def gone(self, engine: Engine) -> int | None:
        assert engine.process is not None
        return await engine.process.wait()

    def announce(self, engine: Engine) -> None:
        self.log.append((engine.state.value, engine.id))


class Harness:
    def __init__(self, tmp: Path, **limits: Any) -> None:
        self.launcher = FakeLauncher()
        self.routings: list[Routing] = []
        settings = {"crash_backoff": 0.05, "crash_backoff_max": 0.2, "standby": 1, **limits}
        self.reconciler = Reconciler(tmp, RestartSettings(**settings), self.launcher, SupervisorMetrics(),
                                     self.on_routing)  # fmt: skip
        self.config = EngineConfig(model=tmp / "model", max_num_seqs=4)

    async def on_routing(self, routing: Routing) -> None:
        """The relays take a moment to acknowledge a table: an engine must not be drained before they have."""
        self.routings.append(routing)
        active = routing.active.id if routing.active else 0
        self.launcher.log.append(("route", active))
        await asyncio.sleep(0.02)
        self.launcher.log.append(("routed", active))

    @property
    def active(self) -> Engine | None:
        return self.reconciler.active

    def routed_all(self) -> bool:
        """Every table handed to the relays so far is acknowledged (a late one would land in a cleared log)."""
        kinds = [kind for kind, _ in self.launcher.log]
        return kinds.count("route") == kinds.count("routed")

    async def until(self, condition: Any, what: str, timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            while not condition():
                await asyncio.sleep(0.005)

    async def standby_ready(self) -> Engine:
        await self.until(lambda: self.reconciler.standbys(), "a standby")
        return self.reconciler.standbys()[0]


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    h = Harness(tmp_path)
    h.reconciler.start()
    yield h
    await h.reconciler.close()


async def test_start_builds_a_standby_and_a_crash_promotes_it(harness: Harness) -> None:
    report = await harness.reconciler.restart(harness.config, "overlap", "start")
    assert report.ok and report.engine == 1 and report.path == "fork" and report.weight_source == "ipc"
    standby = await harness.standby_ready()
    assert standby.id == 2 and harness.active is not None and harness.active.id == 1
    crashed = harness.active
    assert crashed.process is not None
    crashed.process.kill()
    await harness.until(lambda: harness.active is standby, "the standby took over")
    crash = harness.reconciler.reports[-1]
    assert crash.reason == "crash" and crash.ok and crash.path == "standby" and crash.engine == 2
    assert crashed.state is EngineState.FAILED and crashed.id not in harness.reconciler.engines
    assert ("probe", 2) in harness.launcher.log  # a standby answers a real generation before it takes traffic
    replacement = await harness.standby_ready()
    assert replacement.id == 3


async def test_missing_standbys_are_built_side_by_side(tmp_path: Path) -> None:
    """Two standbys wanted: both start at once (one at a time left back-to-back restarts on the H200 without one),
    and two restarts in a row take one each, their replacements started together again."""
    h = Harness(tmp_path, standby=2)
    for engine_id in (2, 3):
        h.launcher.hold[engine_id] = asyncio.Event()
    h.reconciler.start()
    try:
        await h.reconciler.restart(h.config, "overlap", "start")
        await h.until(lambda: {("start", 2), ("start", 3)} <= set(h.launcher.log), "both standbys starting")
        assert not h.reconciler.standbys()  # both held mid-start, side by side
        for event in h.launcher.hold.values():
            event.set()
        await h.until(lambda: len(h.reconciler.standbys()) == 2, "two standbys")
        for engine_id in (4, 5):
            h.launcher.hold[engine_id] = asyncio.Event()
        first = await h.reconciler.restart(None, "overlap", "admin")
        second = await h.reconciler.restart(None, "overlap", "admin")
        assert first.path == second.path == "standby" and {first.engine, second.engine} == {2, 3}
        await h.until(lambda: {("start", 4), ("start", 5)} <= set(h.launcher.log), "both replacements starting")
        for engine_id in (4, 5):
            h.launcher.hold[engine_id].set()
        await h.until(lambda: len(h.reconciler.standbys()) == 2, "two standbys again")
    finally:
        await h.reconciler.close()


async def test_a_restart_takes_a_standby_still_starting_rather_than_launching_another(harness: Harness) -> None:
    """The standby being built began earlier than any engine the restart could launch now: the restart waits for
    it (its report says standby, with the wait), and the next standby is built meanwhile."""
    harness.launcher.hold[2] = asyncio.Event()
    await harness.reconciler.restart(harness.config, "overlap", "start")
    await harness.until(lambda: ("start", 2) in harness.launcher.log, "the standby starting")
    restart = asyncio.ensure_future(harness.reconciler.restart(None, "overlap", "admin"))
    await harness.until(lambda: harness.reconciler._restart is not None and
                        harness.reconciler._restart.candidate is not None, "the restart's candidate")  # fmt: skip
    assert not restart.done() and harness.reconciler._restart.candidate.id == 2
    harness.launcher.hold[2].set()
    report = await restart
    assert report.ok and report.engine == 2 and report.path == "standby"
    assert {"init", "standby_wait", "activate", "switch"} <= set(report.phases), report.phases  # its start's too
    assert (await harness.standby_ready()).id == 3


async def test_back_to_back_restarts_do_not_wait_for_the_drains_of_the_engines_they_replaced(tmp_path: Path) -> None:
    """Restarts 1 s apart on the H200 waited each for the drain before (its old engine's streams), so the standbys
    were not rebuilt meanwhile and most took the fork path, answered ever later. Now a restart is done with the
    loop at its switch: while the engines they replaced still drain, three restarts in a row each take a standby
    and the next ones are built; a `wait: drained` report still comes once its old engine has stopped."""
    h = Harness(tmp_path, standby=2)
    h.reconciler.start()
    try:
        await h.reconciler.restart(h.config, "overlap", "start")
        await h.until(lambda: len(h.reconciler.standbys()) == 2, "two standbys")
        h.launcher.draining.clear()  # no retired engine finishes its drain from now on
        drained = asyncio.ensure_future(h.reconciler.restart(None, "overlap", "admin"))
        await h.until(lambda: h.active is not None and h.active.id != 1, "the first switch")
        reports = [await h.reconciler.restart(None, "overlap", "admin", at_switch=True) for _ in range(2)]
        assert [r.path for r in reports] == ["standby", "standby"] and all(r.ok for r in reports), reports
        assert all(r.drained is False for r in reports) and not drained.done()
        draining = [e for e in h.reconciler.engines.values() if e.state is EngineState.DRAINING]
        assert len(draining) == 3, draining  # engine 1 and the two the later restarts replaced, all still draining
        await h.until(lambda: len(h.reconciler.standbys()) == 2, "two standbys rebuilt while they drain")
        h.launcher.draining.set()
        report = await drained
        assert report.ok and report.drained is True and "drain" in report.phases, report
        await h.until(lambda: all(r.drained for r in h.reconciler.reports if r.reason == "admin"), "drains listed")
    finally:
        await h.reconciler.close()


async def test_a_restart_that_starts_its_own_engine_has_no_standby_build_beside_it(tmp_path: Path) -> None:
    """On the H200 under load, the fork path's start took 0.7-1.0 s more beside standby builds: those of the config
    it replaces (useless once it switches) and those of its own config begun with it. A restart to another config
    now stops the old config's builds at once, and its config's standbys are built after its switch."""
    h = Harness(tmp_path, standby=2)
    for engine_id in (2, 3, 4):
        h.launcher.hold[engine_id] = asyncio.Event()
    h.reconciler.start()
    try:
        await h.reconciler.restart(h.config, "overlap", "start")
        await h.until(lambda: {("start", 2), ("start", 3)} <= set(h.launcher.log), "both standbys starting")
        builds = [h.reconciler.engines[2], h.reconciler.engines[3]]
        other = h.config.model_copy(update={"max_num_seqs": 8})
        restart = asyncio.ensure_future(h.reconciler.restart(other, "overlap", "admin"))
        await h.until(lambda: ("start", 4) in h.launcher.log, "the restart's own engine starting")
        await h.until(lambda: all(b.process is not None and b.process.returncode is not None for b in builds),
                      "the old config's builds stopped")  # fmt: skip
        assert all(b.state is EngineState.FAILED and b.id not in h.reconciler.engines for b in builds)
        await asyncio.sleep(0.1)
        assert not restart.done() and ("start", 5) not in h.launcher.log  # nothing built beside the start
        h.launcher.hold[4].set()
        report = await restart
        assert report.ok and report.engine == 4 and report.path == "fork", report
        await h.until(lambda: len(h.reconciler.standbys()) == 2, "its config's standbys, built after the switch")
        assert {e.config.max_num_seqs for e in h.reconciler.standbys()} == {8}
    finally:
        await h.reconciler.close()


async def test_overlap_switches_first_and_drains_the_old_engine_once_the_relays_have_the_new_table(
    harness: Harness,
) -> None:
    await harness.reconciler.restart(harness.config, "overlap", "start")
    await harness.standby_ready()
    harness.launcher.log.clear()
    report = await harness.reconciler.restart(None, "overlap", "admin")
    assert report.ok and report.path == "standby" and report.engine == 2
    log = harness.launcher.log
    assert log.index(("routed", 2)) < log.index(("retire", 1)), log  # the relays moved before the drain began
    assert {"probe", "switch", "drain", "total"} <= set(report.phases), report.phases
    assert harness.active is not None and harness.active.id == 2


async def test_replace_drains_the_old_engine_before_the_new_one_takes_over(tmp_path: Path) -> None:
    h = Harness(tmp_path, standby=0)
    h.reconciler.start()
    try:
        await h.reconciler.restart(h.config, "overlap", "start")
        await h.until(lambda: h.routed_all(), "the relays' acknowledgements of the start's tables")
        h.launcher.log.clear()
        report = await h.reconciler.restart(None, "replace", "admin")
        assert report.ok and report.path == "fork" and report.engine == 2
        log = h.launcher.log
        # No engine while the old one drains (the relays hold requests meanwhile), then the new one starts.
        retire = log.index(("retire", 1))
        assert log.index(("route", 0)) < log.index(("routed", 0)) < retire < log.index(("start", 2)), log
        assert log.index(("route", 2)) > log.index(("start", 2))
        assert "drain" in report.phases and "switch" in report.phases
    finally:
        await h.reconciler.close()


async def test_a_failed_start_keeps_the_old_engine_or_brings_the_last_good_config_back(harness: Harness) -> None:
    await harness.reconciler.restart(harness.config, "overlap", "start")
    await harness.standby_ready()
    bad = harness.config.model_copy(update={"max_num_seqs": 99})
    harness.launcher.fail_starts.add(3)
    report = await harness.reconciler.restart(bad, "overlap", "admin")
    assert not report.ok and "exited with 1" in (report.error or "")
    assert harness.active is not None and harness.active.id == 1  # overlap: the old engine never stopped serving
    harness.launcher.fail_starts.add(4)
    report = await harness.reconciler.restart(bad, "replace", "admin")
    assert not report.ok and harness.active is None
    # The last good config comes back by itself: the standby (built for it) is promoted.
    await harness.until(lambda: harness.active is not None, "recovery after a failed replace")
    recovery = harness.reconciler.reports[-1]
    assert recovery.reason == "replace failed" and recovery.ok and recovery.path == "standby"
    assert harness.active is not None and harness.active.config == harness.config


async def test_a_crash_while_another_engine_starts_is_handled_at_once(harness: Harness) -> None:
    await harness.reconciler.restart(harness.config, "overlap", "start")
    standby = await harness.standby_ready()
    other = harness.config.model_copy(update={"max_num_seqs": 8})  # no standby matches: an engine starts
    harness.launcher.hold[3] = asyncio.Event()
    restart = asyncio.create_task(harness.reconciler.restart(other, "overlap", "admin"))
    await harness.until(lambda: ("start", 3) in harness.launcher.log, "the new engine starting")
    old = harness.active
    assert old is not None and old.process is not None
    old.process.kill()  # the active engine crashes while engine 3 starts
    await harness.until(lambda: old.state is EngineState.FAILED, "the crash noticed while a start is pending")
    assert harness.active is None and harness.routings[-1].active is None  # the relays stop sending it requests
    harness.launcher.hold[3].set()
    report = await restart
    assert report.ok and report.engine == 3 and harness.active is not None and harness.active.id == 3
    # The standby of the old config is retired; one of the new config is built.
    await harness.until(lambda: standby.state is EngineState.STOPPED, "the stale standby retired")
    fresh = await harness.standby_ready()
    assert fresh.config == other


async def test_a_hung_engine_is_killed_and_replaced_and_a_refused_standby_is_skipped(harness: Harness) -> None:
    await harness.reconciler.restart(harness.config, "overlap", "start")
    standby = await harness.standby_ready()
    harness.launcher.refuse_probe.add(standby.id)
    hung = harness.active
    assert hung is not None
    harness.reconciler.post(Hung(hung, 12.0))
    await harness.until(lambda: harness.active is not None and harness.active is not hung, "a replacement")
    assert hung.process is not None and hung.process.returncode == -signal.SIGKILL
    report = harness.reconciler.reports[-1]
    assert report.reason == "crash" and report.path == "fork"  # the standby refused its probe: a new engine
    assert standby.state is EngineState.FAILED


async def test_requests_are_carried_out_one_after_the_other(harness: Harness) -> None:
    await harness.reconciler.restart(harness.config, "overlap", "start")
    await harness.standby_ready()
    reports = await asyncio.gather(*(harness.reconciler.restart(None, s, "admin")
                                     for s in ("overlap", "replace", "overlap")))  # fmt: skip
    assert [r.ok for r in reports] == [True, True, True]
    assert len({r.engine for r in reports}) == 3  # each request got an engine of its own
    assert sum(1 for e in harness.reconciler.engines.values() if e.state is EngineState.ACTIVE) == 1


async def test_settings_change_the_standbys_and_a_crash_loop_backs_off(harness: Harness) -> None:
    await harness.reconciler.restart(harness.config, "overlap", "start")
    standby = await harness.standby_ready()
    harness.reconciler.configure(RestartSettings(standby=0, crash_backoff=0.05, crash_backoff_max=0.2))
    await harness.until(lambda: standby.state is EngineState.STOPPED, "a standby beyond the count retired")
    # Every start fails from now on: after a crash the reconciler tries again, later each time, and never gives up.
    harness.launcher.fail_starts.update(range(3, 10))
    active = harness.active
    assert active is not None and active.process is not None
    active.process.kill()
    await harness.until(lambda: len([r for r in harness.reconciler.reports if r.reason == "crash"]) >= 3,
                        "three recovery attempts")  # fmt: skip
    assert harness.active is None
    harness.launcher.fail_starts.clear()
    await harness.until(lambda: harness.active is not None, "recovery once engines start again", timeout=10)


async def test_exits_of_engines_being_retired_are_not_crashes(harness: Harness) -> None:
    await harness.reconciler.restart(harness.config, "overlap", "start")
    await harness.standby_ready()
    await harness.reconciler.restart(None, "overlap", "admin")
    assert harness.reconciler.metrics.crashes._value.get() == 0  # type: ignore[attr-defined]
    stray = Engine(99, Path("x"), Path("y"), Path("z"), harness.config, state=EngineState.DRAINING)
    harness.reconciler.post(Exited(stray, 0))  # an engine nobody routes to: nothing happens
    await asyncio.sleep(0.05)
    assert harness.active is not None


def test_the_state_machine_refuses_what_it_does_not_have(tmp_path: Path) -> None:
    engine = Engine(1, tmp_path / "s", tmp_path / "l", tmp_path / "b", EngineConfig(model=tmp_path))
    for to in (EngineState.ACTIVE, EngineState.STANDBY, EngineState.DRAINING):
        with pytest.raises(IllegalTransition):
            transition(engine, to)  # a starting engine serves nobody before it is ready
    transition(engine, EngineState.READY)
    transition(engine, EngineState.STANDBY)
    transition(engine, EngineState.ACTIVE)
    with pytest.raises(IllegalTransition):
        transition(engine, EngineState.STANDBY)


async def test_recovery_attempts_after_a_crash_wait_twice_as_long_each_time_up_to_the_cap(tmp_path: Path) -> None:
    """crash_backoff 0.4 s, crash_backoff_max 1.6 s: while every start fails, the recovery attempts after a crash
    of the active engine begin at once, then 0.4, 0.8, 1.6 and 1.6 s apart (each attempt's report is made when it
    begins: its ``at``); once starts succeed an attempt recovers, and the delays start over from crash_backoff."""
    import time  # (appended test: the module's imports are left as they are)

    first, cap = 0.4, 1.6
    h = Harness(tmp_path, standby=0, crash_backoff=first, crash_backoff_max=cap)
    h.reconciler.start()

    def attempts() -> list[RestartReport]:
        return [r for r in h.reconciler.reports if r.reason == "crash"]

    try:
        await h.reconciler.restart(h.config, "overlap", "start")
        h.launcher.fail_starts.update(range(2, 1000))  # every engine started from now on exits during start-up
        active = h.active
        assert active is not None and active.process is not None
        crashed_at = time.time()
        active.process.kill()
        await h.until(lambda: len(attempts()) >= 5, "five recovery attempts", timeout=20)
        tries = attempts()[:5]
        assert not any(r.ok for r in tries) and h.active is None, [r.to_json() for r in tries]
        assert tries[0].at - crashed_at < first / 2, tries[0].at - crashed_at  # the first attempt: at once
        gaps = [round(b.at - a.at, 3) for a, b in itertools.pairwise(tries)]
        expected = [first, 2 * first, cap, cap]  # doubling, then held at crash_backoff_max
        for gap, want in zip(gaps, expected, strict=True):
            assert want - 0.02 <= gap <= want + 0.3, (gaps, expected)

        h.launcher.fail_starts.clear()
        await h.until(lambda: h.active is not None, "recovery once engines start again", timeout=10)
        recovery = attempts()[-1]
        assert recovery.ok and recovery.engine == h.active.id and recovery.path == "fork", recovery.to_json()

        # A success starts the delays over: after the next crash, the second attempt follows the first by
        # crash_backoff again, not by the cap reached before.
        done = len(attempts())
        h.launcher.fail_starts.update(range(1, 1000))
        active = h.active
        assert active is not None and active.process is not None
        active.process.kill()
        await h.until(lambda: len(attempts()) >= done + 2, "two more recovery attempts", timeout=10)
        again = attempts()[done : done + 2]
        assert first - 0.02 <= again[1].at - again[0].at <= first + 0.3, [r.at for r in again]
        h.launcher.fail_starts.clear()
        await h.until(lambda: h.active is not None, "recovery again", timeout=10)
    finally:
        await h.reconciler.close()


async def test_an_adopted_active_engine_without_a_standby_gets_one_with_no_other_event(tmp_path: Path) -> None:
    """An earlier supervisor died while its standby was starting (that one is stopped at adoption): the next one
    adopts the active engine alone, and its loop starts a standby although nothing else happens."""
    h = Harness(tmp_path)
    active = Engine(7, tmp_path / "engine-7.sock", tmp_path / "engine-7.log", tmp_path / "engine-7.beat", h.config,
                    process=FakeProcess(), path="fork")  # fmt: skip
    h.reconciler.adopt([(active, EngineState.ACTIVE)])
    h.reconciler.start()
    try:
        standby = await h.standby_ready()
        assert standby.id == 8 and h.active is active and ("start", 8) in h.launcher.log
    finally:
        await h.reconciler.close()


async def test_every_engine_commits_its_kv_cache_before_it_takes_traffic_and_one_that_cannot_is_not_used(
    harness: Harness,
) -> None:
    """Activation (the engine commits its reserved KV cache) comes after a standby's probe and before the relays
    get the table that routes to it; a standby that cannot commit is replaced by a new engine, and a new engine
    that cannot fails the restart while the old one serves on (overlap)."""
    await harness.reconciler.restart(harness.config, "overlap", "start")
    log = harness.launcher.log
    assert log.index(("activate", 1)) < log.index(("route", 1)), log  # the first engine too
    standby = await harness.standby_ready()
    assert ("activate", standby.id) not in log  # a standby holds no KV cache until it is promoted
    log.clear()
    report = await harness.reconciler.restart(None, "overlap", "admin")
    assert report.ok and report.path == "standby" and "activate" in report.phases, report
    assert log.index(("probe", standby.id)) < log.index(("activate", standby.id)) < log.index(("route", standby.id))
    refused = await harness.standby_ready()
    harness.launcher.refuse_activation.add(refused.id)
    report = await harness.reconciler.restart(None, "overlap", "admin")
    # its place taken by the standby built meanwhile (or a new engine, had none been ready)
    assert report.ok and report.engine != refused.id and refused.state is EngineState.FAILED, report
    assert harness.active is not None and harness.active.id not in (standby.id, refused.id)
    serving = harness.active
    await harness.standby_ready()
    other = harness.config.model_copy(update={"max_num_seqs": 8})  # no standby: a new engine, which cannot commit
    harness.launcher.refuse_activation.add(max(harness.reconciler.engines) + 1)
    report = await harness.reconciler.restart(other, "overlap", "admin")
    assert not report.ok and "50.0 GB" in (report.error or ""), report
    assert harness.active is serving  # overlap: the old engine never stopped serving


async def test_a_standby_build_stopped_as_its_start_ends_is_not_kept_and_its_exit_is_no_crash(tmp_path: Path) -> None:
    """A restart to another config stops the standby builds of the config it replaces, still the desired one until
    the restart switches. A build whose start succeeds all the same (its ready line read as the stop came) must not
    be kept as a standby: it was kept, and its exit from the stop counted as a crash (seen once in CI's gateway
    test: `standby_build_stopped`, then `standby_ready` and `engine_crashed` for the same engine)."""
    h = Harness(tmp_path)
    h.launcher.hold[2], h.launcher.hold[3] = asyncio.Event(), asyncio.Event()
    h.launcher.ready_anyway.add(2)
    h.reconciler.start()
    try:
        await h.reconciler.restart(h.config, "overlap", "start")
        await h.until(lambda: ("start", 2) in h.launcher.log, "the standby build starting")
        build = h.reconciler.engines[2]
        other = h.config.model_copy(update={"max_num_seqs": 8})
        restart = asyncio.ensure_future(h.reconciler.restart(other, "overlap", "admin"))
        await h.until(
            lambda: (
                ("start", 3) in h.launcher.log and build.process is not None and build.process.returncode is not None
            ),
            "the build stopped, the restart's engine starting",
        )
        h.launcher.hold[2].set()  # its start reports ready after all, while the restart has not switched yet
        await h.until(lambda: build.state is not EngineState.STARTING, "the build's late start handled")
        h.launcher.hold[3].set()
        report = await restart
        assert report.ok and report.engine == 3, report
        await h.until(lambda: build.state in (EngineState.STOPPED, EngineState.FAILED), "the build's exit handled")
        assert h.reconciler.metrics.crashes._value.get() == 0  # type: ignore[attr-defined]
        assert build not in h.reconciler.standbys() and build.state is not EngineState.STANDBY
    finally:
        await h.reconciler.close()
