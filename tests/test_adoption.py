"""The pieces a new supervisor adopts a running gateway with, each on its own: the listening socket handed over by a
relay (common/handoff.py), a process that is not our child watched and signalled (AdoptedProcess), the state an
earlier supervisor left (app/supervisor/state.py), and the processes of a run dir found by their titles.
(tests/fault/ runs the whole: kill -9 of the supervisor and of `warmgate serve`, `warmgate upgrade`.)"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.supervisor.state import EngineRecord, GatewayState, ProcessRecord
from common import handoff
from common.processes import AdoptedProcess, gateway_processes, start_time
from engine.config import EngineConfig


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    path.mkdir(mode=0o700)
    return path


def test_a_listening_socket_is_handed_over_and_a_dead_offer_is_cleared(run_dir: Path) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(run_dir / "handoff-0.sock"))  # a relay that died: its socket file, nobody listening
    stale.close()
    offering = handoff.offer(run_dir / "handoff-1.sock", listener)
    try:
        taken = handoff.take(run_dir)
        assert taken is not None and handoff.identity(taken) == handoff.identity(listener)  # the same socket
        assert taken.getsockname() == listener.getsockname()
        assert not (run_dir / "handoff-0.sock").exists(), "a dead offer was left in the run dir"
        client = socket.create_connection(listener.getsockname())  # accepted on the copy: one socket, one queue
        accepted, _ = taken.accept()
        accepted.close()
        client.close()
        taken.close()
    finally:
        offering.close()
        listener.close()
    (run_dir / "handoff-1.sock").unlink()
    assert handoff.take(run_dir) is None


def test_a_process_that_is_not_ours_is_watched_and_signalled_through_its_pidfd() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(ProcessLookupError):  # a pid now held by another process than the one recorded
            AdoptedProcess(child.pid, (start_time(child.pid) or 0) + 1)

        async def watch() -> int:
            adopted = AdoptedProcess(child.pid, start_time(child.pid))
            assert adopted.returncode is None
            waiting = asyncio.ensure_future(adopted.wait())
            await asyncio.sleep(0.1)
            assert not waiting.done()
            adopted.send_signal(signal.SIGTERM)
            code = await asyncio.wait_for(waiting, 10)
            assert adopted.returncode == code
            adopted.kill()  # after its exit: nothing is signalled (its pid may be another process's by now)
            return code

        assert asyncio.run(watch()) == AdoptedProcess.EXIT_UNKNOWN
        assert child.wait(timeout=10) == -signal.SIGTERM
    finally:
        child.kill()
        child.wait()


def test_the_state_an_earlier_supervisor_left_is_read_back_or_ignored(run_dir: Path) -> None:
    assert GatewayState.load(run_dir) is None
    config = EngineConfig(model=run_dir, max_num_seqs=4)
    record = EngineRecord(id=3, state="active", process=ProcessRecord.of(os.getpid()), socket=run_dir / "e.sock",
                          log_path=run_dir / "e.log", heartbeat_path=run_dir / "e.beat", config=config,
                          path="fork")  # fmt: skip
    state = GatewayState(supervisor=os.getpid(), engines=[record], engine_overrides={"max_num_seqs": 4},
                         table_generation=17)  # fmt: skip
    state.save(run_dir)
    assert GatewayState.load(run_dir) == state
    assert record.process.alive() and not ProcessRecord(pid=os.getpid(), started=1).alive()
    (run_dir / "state.json").write_text('{"supervisor": "not a pid"')  # a newer format, or a torn write
    assert GatewayState.load(run_dir) is None
    GatewayState.remove(run_dir)
    assert not (run_dir / "state.json").exists()


def test_the_processes_of_a_run_dir_are_found_by_their_titles(run_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "other" / "run"  # a run dir whose path ends like ours must not match
    code = "import setproctitle, sys, time; setproctitle.setproctitle(sys.argv[1]); time.sleep(60)"
    titles = [f"warmgate: relay 3 {run_dir}", f"warmgate: engine 2-7 standby {run_dir}", f"warmgate: relay 0 {other}",
              f"warmgate: something else {run_dir}"]  # fmt: skip
    procs = [subprocess.Popen([sys.executable, "-c", code, title]) for title in titles]
    try:
        deadline = time.monotonic() + 30
        while len(found := gateway_processes(run_dir)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        mine = sorted((p.pid, p.role, p.words) for p in found)
        assert mine == sorted([(procs[0].pid, "relay", ("3",)), (procs[1].pid, "engine", ("2-7", "standby"))])
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_an_engine_whose_health_goes_unanswered_is_adopted_while_its_heartbeat_is_fresh(run_dir: Path) -> None:
    """A new supervisor keeps an engine that is alive by liveness's rule (a fresh heartbeat) though its /health did
    not answer in time (a busy machine), and drains and stops one whose heartbeat has been silent too."""
    from app.supervisor.adopt import adopt_engines
    from app.supervisor.engines import Engine, EngineState
    from common.heartbeat import ENGINE_THREAD, EVENT_LOOP, Heartbeat

    class Unanswering:
        def __init__(self) -> None:
            self.retired: list[int] = []

        async def health(self, engine: Engine, timeout: float) -> None:
            return None

        async def retire(self, engine: Engine, drain_timeout: float) -> None:
            self.retired.append(engine.id)

    class Adopting:
        def __init__(self) -> None:
            self.run_dir, self.kept = run_dir, list[tuple[int, EngineState]]()

        def adopt(self, kept: list[tuple[Engine, EngineState]]) -> None:
            self.kept = [(engine.id, state) for engine, state in kept]

    code = "import time; time.sleep(60)"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(2)]
    try:
        config = EngineConfig(model=run_dir, max_num_seqs=4)
        records = []
        for id, (proc, state) in enumerate(zip(procs, ("active", "standby"), strict=True), start=1):
            beat = Heartbeat.create(run_dir / f"engine-{id}.beat")
            if state == "active":  # the standby's heartbeat was never stamped: silent for ever
                beat.beat(ENGINE_THREAD)
                beat.beat(EVENT_LOOP)
            beat.close()
            name = run_dir / f"engine-{id}"
            record = EngineRecord(id=id, state=state, process=ProcessRecord.of(proc.pid),
                                  socket=name.with_suffix(".sock"), log_path=name.with_suffix(".log"),
                                  heartbeat_path=name.with_suffix(".beat"), config=config, path="fork")  # fmt: skip
            records.append(record)
        earlier = GatewayState(supervisor=0, engines=records)
        launcher, reconciler = Unanswering(), Adopting()

        async def adopt() -> None:
            tasks = await adopt_engines(earlier, launcher, reconciler, drain_timeout=1, health_timeout=4)  # type: ignore[arg-type]
            await asyncio.gather(*tasks)

        asyncio.run(adopt())
        assert reconciler.kept == [(1, EngineState.ACTIVE)]
        assert launcher.retired == [2]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
