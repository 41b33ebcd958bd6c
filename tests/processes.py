"""Real warmgate processes for tests: engine workers and cache processes on real Unix sockets."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from cache.client import CacheClient, CacheUnavailable

REPO = Path(__file__).resolve().parents[1]
START_DEADLINE = 240.0  # seconds; start-up takes seconds here (a vLLM engine 20-80 s on 2 busy cores)
MAX_MODEL_LEN = 1024  # small KV cache: a faster start, and a prompt that is too long stays cheap to build


@dataclass
class Process:
    proc: subprocess.Popen[bytes]
    socket: Path
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text()

    def exit_code(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Worker(Process):
    def client(self, timeout: float = 60) -> httpx.AsyncClient:
        transport = httpx.AsyncHTTPTransport(uds=str(self.socket))
        return httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=timeout)

    def sync_client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket)), base_url="http://engine", timeout=300)

    def wait_ready(self) -> None:
        """Wait until /health answers 200 (fails the test if the worker dies or the deadline passes)."""

        def healthy() -> bool:
            try:
                with self.sync_client() as client:
                    return client.get("/health").status_code == 200
            except httpx.TransportError:
                return False

        _wait(self, healthy, "engine worker")


def _spawn(args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log:
        cmd = [sys.executable, "-m", "app.cli", *args]
        return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def _wait(process: Process, ready: Any, what: str) -> None:
    """Poll ``ready()`` until it is true; fail if the process dies or the deadline passes."""
    deadline = time.monotonic() + START_DEADLINE
    while time.monotonic() < deadline:
        if process.socket.exists() and ready():
            return
        try:  # doubles as the poll interval: returns at once if the process died
            code = process.proc.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            continue
        pytest.fail(f"{what} exited with {code} during start-up:\n{process.log()}")
    process.stop()
    pytest.fail(f"{what} not ready after {START_DEADLINE}s:\n{process.log()}")


def start_worker(directory: Path, model: Path, name: str = "engine", **config: Any) -> Worker:
    """Start `warmgate engine` and wait until /health answers."""
    worker = launch_worker(directory, model, name, **config)
    worker.wait_ready()
    return worker


def launch_worker(directory: Path, model: Path, name: str = "engine", **config: Any) -> Worker:
    """Start `warmgate engine` without waiting (start several at once, then ``wait_ready`` each)."""
    sock = directory / f"{name}.sock"
    # The CPU unless a test says otherwise: the caches these tests start keep their weights on the CPU.
    settings = {"model": str(model), "device": "cpu", "max_num_seqs": 8, "max_model_len": MAX_MODEL_LEN, **config}
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in settings.items()}
    proc = _spawn(["engine", "--socket", str(sock), "--config", json.dumps(settings)], directory / f"{name}.log")
    return Worker(proc, sock, directory / f"{name}.log")


def start_cache(directory: Path, model: Path, device: str = "cpu", backend: str = "native") -> Process:
    """Start `warmgate cache` (socket in a private run dir under ``directory``) and wait until it answers."""
    cache = launch_cache(directory, model, device, backend)
    wait_cache(cache)
    return cache


def launch_cache(directory: Path, model: Path, device: str = "cpu", backend: str = "native") -> Process:
    """Start `warmgate cache` without waiting for it (``wait_cache``)."""
    sock = directory / "run" / "cache.sock"
    log_path = directory / "cache.log"
    args = ["cache", "--model", str(model), "--socket", str(sock), "--device", device, "--backend", backend]
    return Process(_spawn(args, log_path), sock, log_path)


def wait_cache(cache: Process) -> None:
    def answers() -> bool:
        try:
            CacheClient(cache.socket).close()
            return True
        except CacheUnavailable:
            return False

    _wait(cache, answers, "cache process")


def wait_for(condition: Any, seconds: float, what: str) -> Any:
    """Poll ``condition()`` until it returns something true, and return that; fail the test with
    "``what`` within ``seconds`` s" if it does not come."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"{what} within {seconds} s")


def serve_activated(engine: Any, prompts: list[list[int]], params: Any, activate_timeout: float) -> list[list[int]]:
    """An in-process engine (engine/native/llm_engine.py) started and activated as the supervisor promotes a standby,
    then the prompts submitted together: each one's token ids."""

    async def serve() -> list[list[int]]:
        engine.start()
        await asyncio.wait_for(asyncio.wrap_future(engine.activate(activate_timeout)), 60)
        streams = [engine.submit(prompt, params) for prompt in prompts]
        return [[e.token_id async for e in stream if e.token_id is not None] for stream in streams]

    return asyncio.run(serve())


def check_attached_share_one_copy(cache: Process, attached: list[Worker], outputs: dict[str, Any],
                                  disk_anon: int) -> int:  # fmt: skip
    """The four-path check's common half, for any backend: every engine's greedy output (``outputs``, keyed
    by path) is the disk engine's; the ``attached`` engines hold the cache's leases, say they came from
    ``ipc`` with the cache's key, map the cache's own memfd arena, and hold no private copy of the weights
    (their RssAnon is below the disk engine's, ``disk_anon``, by over half the arena: a private copy would put
    the two within the noise of everything else an engine allocates, which CI has seen reach 40 MB, a quarter
    of the fp8-channel demo's 164 MB arena).
    Returns the arena's size, for the backend's own checks."""
    for path, output in outputs.items():
        assert output == outputs["disk"], path
    with CacheClient(cache.socket) as client:
        stats, manifest = client.stats(), client.manifest()
    arena_bytes, cache_arenas = stats.bytes, memfd_arenas(cache.pid)
    assert sorted(lease.pid for lease in stats.leases) == sorted(worker.pid for worker in attached)
    for worker in attached:
        weights = health(worker)["weights"]
        assert weights["source"] == "ipc" and weights["key"] == manifest.key and weights["fallbacks"] == 0, weights
        assert memfd_arenas(worker.pid) == cache_arenas  # the cache's memfd (same inode) mapped: no copy
        anon = proc_status(worker.pid)["RssAnon"]
        assert disk_anon - anon > 0.5 * arena_bytes, (disk_anon, anon, arena_bytes)
    return int(arena_bytes)


def proc_status(pid: int) -> dict[str, int]:
    """Memory counters of a process, in bytes: RssAnon (private), RssShmem (shared memory it maps), ..."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            out[key] = int(value.split()[0]) * 1024
    return out


def memfd_arenas(pid: int) -> set[int]:
    """Inodes of the cache arenas (memfds named warmgate-arena) a process has mapped."""
    inodes = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and "memfd:warmgate-arena" in fields[5]:
            inodes.add(int(fields[4]))
    return inodes


GATEWAY_START_DEADLINE = 180.0


@dataclass
class Gateway:
    """A `warmgate serve` process on a loopback port, with its run dir and log (``url`` is empty until it is known)."""

    proc: subprocess.Popen[bytes]
    url: str
    run_dir: Path
    config: Path | None  # the config file it was started with, if any
    log_path: Path

    def token(self) -> str:
        return (self.run_dir / "admin-token").read_text().strip()

    def admin(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"authorization": f"Bearer {self.token()}"}
        return httpx.request(method, f"{self.url}{path}", headers=headers, timeout=300, **kwargs)

    def status(self) -> dict[str, Any]:
        return self.admin("GET", "/admin/status").json()  # type: ignore[no-any-return]

    def metric(self, name: str) -> float:
        """A sample of the gateway's /metrics by name, labelled or not (a counter's ``_total``); 0 while it has none."""
        text = httpx.get(f"{self.url}/metrics").text
        found = re.search(rf"^{re.escape(name)}(?:_total)?(?:{{[^}}]*}})? (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    def active_pid(self) -> int | None:
        status = self.status()
        return next((e["pid"] for e in status["engines"] if e["id"] == status["active"]), None)

    def stop(self) -> None:
        """SIGTERM; the gateway must exit 0 and leave no process (relays, engines, fork server, cache: they outlive a
        supervisor that dies, not one that stops) and no socket behind, nor its address."""
        from common.processes import gateway_processes

        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=120) == 0, self.log_path.read_text()[-3000:]
        assert not gateway_processes(self.run_dir), f"processes left behind: {gateway_processes(self.run_dir)}"
        assert not list(self.run_dir.glob("*.sock")), "sockets left behind"
        assert not (self.run_dir / "address").exists(), "the address of a stopped gateway left behind"

    def kill(self) -> None:
        """The end of a test that killed parts of the gateway: `warmgate stop` stops whatever still runs."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        cmd = [sys.executable, "-m", "app.cli", "stop", "--run-dir", str(self.run_dir)]
        subprocess.run(cmd, cwd=REPO, capture_output=True, timeout=180)


def start_gateway(root: Path, config_text: str, env: dict[str, str] | None = None) -> Gateway:
    """Write the config, start `warmgate serve` on a port of its choosing (``--port 0``: no two tests can race for
    one), ``env`` added to its environment, and wait until /ready answers."""
    config = root / "warmgate.toml"
    config.write_text(config_text)
    log_path = root / "serve.log"
    cmd = [sys.executable, "-m", "app.cli", "serve", "--config", str(config), "--port", "0",
           "--run-dir", str(root / "run")]  # fmt: skip
    with log_path.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    return wait_until_ready(Gateway(proc, "", root / "run", config, log_path))


def wait_until_ready(gw: Gateway) -> Gateway:
    """Poll the gateway's /ready until it answers 200 (its URL, if not known, read from the address it records in
    its run dir); fail (with its log) if it exits or takes too long."""
    from app.supervisor.run_dir import read_address

    deadline = time.monotonic() + GATEWAY_START_DEADLINE
    while time.monotonic() < deadline:
        assert gw.proc.poll() is None, gw.log_path.read_text()
        try:
            if not gw.url:
                gw.url = read_address(gw.run_dir).url
            if httpx.get(f"{gw.url}/ready", timeout=30).status_code == 200:
                return gw
        except (httpx.TransportError, FileNotFoundError):
            pass
        time.sleep(0.2)
    gw.kill()
    pytest.fail(f"gateway not ready:\n{gw.log_path.read_text()}")


PROMPTS = ["The capital of France is", "Write a haiku about the sea."]


def generate(worker: Worker, prompts: list[str] = PROMPTS, tokens: int = 16) -> list[tuple[str, int]]:
    """Greedy completions (``tokens`` each) through the worker's OpenAI API: (text, completion tokens)."""
    out = []
    with worker.sync_client() as client:
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            data = response.json()
            out.append((data["choices"][0]["text"], data["usage"]["completion_tokens"]))
    assert all(n == tokens for _, n in out)
    return out


def health(worker: Worker) -> dict[str, Any]:
    with worker.sync_client() as client:
        return client.get("/health").json()  # type: ignore[no-any-return]
