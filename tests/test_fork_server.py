"""The fork server as a real process: forked workers, their exit codes, bad requests, and its own death."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import struct
import time
from pathlib import Path

import httpx
import pytest

from app.supervisor.forks import ForkServer, ForkServerUnavailable
from common.uds import private_dir


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    private_dir(path)
    return path


def test_forks_workers_reports_their_exit_and_refuses_bad_requests(run_dir: Path, demo_path) -> None:
    async def scenario() -> None:
        forks = ForkServer(run_dir / "fork.sock", run_dir / "fork-server.log")
        await forks.start()
        try:
            await _exit_code_comes_back(forks, run_dir)
            assert "warmgate: error" in (run_dir / "check.log").read_text()

            # Something that is not a spawn request gets an error reply; the server goes on.
            with socket.socket(socket.AF_UNIX) as raw:
                raw.connect(str(forks.socket))
                body = json.dumps({"op": "shell", "argv": ["sh"]}).encode()
                raw.sendall(struct.pack("!I", len(body)) + body)
                (length,) = struct.unpack("!I", raw.recv(4))
                assert json.loads(raw.recv(length))["ok"] is False

            # A real engine worker, forked: it serves, and kill -9 is reported as -9.
            model = demo_path("bf16")
            config = json.dumps({"model": str(model), "max_num_seqs": 2, "max_model_len": 256})
            sock = run_dir / "engine.sock"
            worker = await forks.spawn(["engine", "--socket", str(sock), "--config", config], run_dir / "engine.log")
            assert _ppid(worker.pid) == forks.process.pid  # type: ignore[union-attr]
            deadline = time.monotonic() + 120
            while not sock.exists():
                assert worker.returncode is None, (run_dir / "engine.log").read_text()
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            transport = httpx.AsyncHTTPTransport(uds=str(sock))
            async with httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=60) as client:
                body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
                reply = await client.post("/v1/completions", json=body)
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
            log = (run_dir / "engine.log").read_text()
            assert "event=startup phase=import" in log and "event=ready" in log
            worker.kill()
            assert await asyncio.wait_for(worker.wait(), 30) == -signal.SIGKILL
        finally:
            await forks.stop()
        assert not forks.socket.exists(), "the fork server removes its socket"
        with pytest.raises(ForkServerUnavailable):
            await forks.spawn(["model", "check", "x"], run_dir / "late.log")

    asyncio.run(scenario())


def test_a_worker_outlives_a_killed_fork_server_and_its_exit_is_still_seen(run_dir: Path, demo_path) -> None:
    async def scenario() -> None:
        forks = ForkServer(run_dir / "fork.sock", run_dir / "fork-server.log")
        await forks.start()
        model = demo_path("bf16")
        config = json.dumps({"model": str(model), "max_num_seqs": 2, "max_model_len": 256})
        sock = run_dir / "engine.sock"
        worker = await forks.spawn(["engine", "--socket", str(sock), "--config", config], run_dir / "engine.log")
        try:
            forks.process.kill()  # type: ignore[union-attr]
            await forks.process.wait()  # type: ignore[union-attr]
            assert not forks.running
            await asyncio.sleep(0.5)
            assert worker.returncode is None, "the worker does not die with the fork server"
            os.kill(worker.pid, signal.SIGTERM)
            code = await asyncio.wait_for(worker.wait(), 60)
            assert code is not None  # unknown once its parent is gone, but its end is noticed
        finally:
            if worker.returncode is None:
                os.kill(worker.pid, signal.SIGKILL)
            sock.unlink(missing_ok=True)

    asyncio.run(scenario())


def test_a_grammar_library_that_fails_to_import_costs_structured_outputs_not_the_fork_server(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """xgrammar importing but failing (on the H200, a wheel without its tvm_ffi dependency) used to kill the fork
    server at its preload, and every engine start fell back to spawning (6-7 s instead of ~2 s). It serves now, and
    says what failed."""
    broken = tmp_path / "broken"
    (broken / "xgrammar").mkdir(parents=True)
    (broken / "xgrammar" / "__init__.py").write_text("from tvm_ffi_that_is_missing import register_error\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(broken), os.environ.get("PYTHONPATH")) if p))

    async def scenario() -> None:
        forks = ForkServer(run_dir / "fork.sock", run_dir / "fork-server.log")
        await forks.start()
        try:
            await _exit_code_comes_back(forks, run_dir)
        finally:
            await forks.stop()

    asyncio.run(scenario())
    log = (run_dir / "fork-server.log").read_text()
    assert "event=preload_failed" in log and "module=xgrammar" in log and "tvm_ffi_that_is_missing" in log
    assert "event=ready" in log


def test_the_fork_server_finds_out_when_its_forks_could_not_use_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its preload's last check forks a child that reads torch's mark of a fork made after the parent asked CUDA
    anything (set by torch in such a child; stood in for here, this machine's torch has no CUDA). On the H100 that
    mark, left by DeepGEMM's import, failed every forked engine's start; the preload now fails instead."""
    import torch

    from engine.fork_server import forks_can_use_cuda

    assert forks_can_use_cuda()
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    assert not forks_can_use_cuda()


async def _exit_code_comes_back(forks: ForkServer, run_dir: Path) -> None:
    """A command that fails at once (checking a missing model): its exit code, 2, comes back through the fork
    server."""
    failing = await forks.spawn(["model", "check", str(run_dir / "missing")], run_dir / "check.log")
    assert await asyncio.wait_for(failing.wait(), 60) == 2


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
