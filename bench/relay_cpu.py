"""The gateway's CPU time per streamed token, with a stub engine (no model) and many concurrent client streams.

    .venv/bin/python bench/relay_cpu.py --modes baseline baseline-uvloop --streams 1000 100
    # writes bench/results/relay_cpu.json and prints a markdown table

What it measures: the CPU seconds (utime + stime in /proc/PID/stat) the gateway's processes use during a
measured window, divided by the tokens the clients received in that window, in microseconds per token.
The gateway, the stub engine (bench/stub_engine.py) and the load client share the machine's cores, so
wall-clock throughput says little about the gateway; its own CPU counters do. The stub's and the
client's CPU are reported alongside, with how busy the whole machine was.

Each row starts a fresh stub and gateway: the stub streams ``--max-tokens`` tokens per request in engine-like
steps (one event per stream per step, as fast as it can unless ``--step-ms``; its connections' small send
buffers keep it a few events ahead of a gateway that reads slower, see bench/stub_engine.py); ``--streams``
client streams (split over ``--client-procs`` processes, uvloop and raw sockets) each send streamed
``/v1/completions`` requests back to back on a keep-alive connection. The window opens ``--warmup`` seconds
after the first token reached a client (the connection burst before it is not measured) and lasts at least
``--window`` seconds and until two requests' worth of tokens per stream have come (``--window-tokens``). A
request counts as ok only if its stream ends with ``data: [DONE]``, carries no error event and no internal
comment, and has exactly ``max_tokens`` token events and that completion_tokens in its usage chunk.

Gateways under test (``--modes``), each a function in GATEWAYS: (stub socket, args) -> RunningGateway:

- ``baseline``: the gateway of commit 9562034 (app/gateway.py's create_gateway, app/engines.py's
  EngineManager with the stub set as its active engine by hand, no reconcile or liveness loops) served by
  uvicorn as app/serve.py served it then: asyncio's event loop and h11 (uvloop and httptools were not
  installed then), from a copy of that commit outside the working tree (``--baseline-dir``).
- ``baseline-uvloop``: the same with uvloop and httptools forced.
- ``relays``: the relay workers of the working tree (app/relay/), ``--relays`` of them, started by the
  supervisor's own relay pool (app/supervisor/relays.py: the shared listening socket, the control channel,
  the admission board) in a stand-in supervisor that only publishes a table whose active engine is the stub
  (with a capacity above any stream count here: admission never queues). The relays' CPU is measured; the
  stand-in's is not (the real supervisor is on no request's path: 0.0-0.2 us per token on the H200).

A new gateway design plugs in as another entry of GATEWAYS (see RunningGateway).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import multiprocessing
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection as PipeEnd
from pathlib import Path
from typing import Any, NamedTuple, cast

ROOT = Path(__file__).resolve().parent.parent
BASELINE_COMMIT = "9562034"
CLK_TCK = os.sysconf("SC_CLK_TCK")

# Slots of a client process's shared counters: the client writes the first four, the orchestrator the rest.
TOKENS, OK, FAILED, READS, PHASE, STOP = range(6)
WARMUP, WINDOW, AFTER = 0, 1, 2  # PHASE values: which phase a failure or latency belongs to


# --- the gateway under test --------------------------------------------------------------------------------------


class RunningGateway(NamedTuple):
    """A started gateway: where clients connect, every process whose CPU counts as the gateway's, how to stop it.

    ``pids`` are read at the start and at the end of the window (each must live through it); processes that
    do the gateway's work (relays, a supervisor) all belong in it, the stub engine does not.
    """

    url: str  # http://host:port
    pids: list[int]
    stop: Callable[[], None]


# (stub socket, args) -> a started gateway that relays to the stub. ``args`` holds the command line, and
# ``args.stub_pid`` the stub's pid (the baseline hands it to EngineManager as its engine's). It returns once
# the gateway is started; run_row then waits for its /health and checks one streamed request through it.
GatewayFactory = Callable[[Path, argparse.Namespace], RunningGateway]


# Today's gateway, built as app/serve.py built it at 9562034, minus the cache, the fork server and the engine
# manager's loops: the stub stands for an active engine that never exits.
BASELINE_LAUNCHER = r"""
import asyncio, contextlib, gc, json, signal, sys
from pathlib import Path

cfg = json.loads(sys.argv[1])
sys.path.insert(0, cfg["root"])  # that commit's app/, engine/, cache/, not the working tree's (an editable install)

import uvicorn

import app.gateway
from app.config import RestartSettings
from app.engines import Engine, EngineManager, EngineState
from app.gateway import GatewayState, create_gateway
from app.metrics import GatewayMetrics

assert app.gateway.__file__.startswith(cfg["root"]), app.gateway.__file__


class StubProcess:
    # The engine process as EngineManager sees one (WorkerProcess): alive, and never exits.
    def __init__(self, pid):
        self.pid, self.returncode = pid, None

    async def wait(self):
        await asyncio.Event().wait()
        return 0

    def send_signal(self, sig):
        pass

    def kill(self):
        pass


class Server(uvicorn.Server):
    # As serve.py: no uvicorn signal handlers; the loop's SIGTERM handler below stops it.
    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def main():
    limits = RestartSettings()
    metrics = GatewayMetrics()
    run_dir = Path(cfg["run_dir"])
    manager = EngineManager(run_dir, limits, metrics, None)
    engine = Engine(1, Path(cfg["socket"]), run_dir / "engine-1.log", {}, StubProcess(cfg["engine_pid"]),
                    state=EngineState.ACTIVE)
    manager.engines[engine.id] = engine
    manager.active = engine

    async def restart(body):
        return {"ok": False, "error": "no restarts in this benchmark"}

    async def reload():
        return {"ok": False, "changed": []}

    async def status():
        return manager.status()

    state = GatewayState(manager, metrics, [], "bench-admin-token", limits.queue_timeout, limits.max_queue,
                         limits.request_resumes, 8 * 2**20, restart, reload, status)
    app = create_gateway(state)
    config = uvicorn.Config(app, host="127.0.0.1", port=cfg["port"], log_config=None, log_level="warning",
                            access_log=False, lifespan="off", **cfg["uvicorn"])
    server = Server(config)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, lambda: setattr(server, "should_exit", True))
    gc.collect()
    gc.freeze()
    await server.serve()


if cfg["uvloop"]:
    import uvloop
    runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
else:
    runner = asyncio.Runner()
with runner:
    runner.run(main())
"""


def baseline_dir(args: argparse.Namespace) -> Path:
    """A copy of the baseline commit outside the working tree (made with git archive when missing)."""
    path = Path(args.baseline_dir)
    if not (path / "app" / "gateway.py").exists():
        path.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", BASELINE_COMMIT], check=True,
                                 capture_output=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(path)], input=archive, check=True)
    return path


def start_baseline(stub_socket: Path, args: argparse.Namespace, fast: bool = False) -> RunningGateway:
    root = baseline_dir(args).resolve()
    port = free_port()
    run_dir = stub_socket.parent
    # serve.py left both at "auto": asyncio and h11 then; "auto" would pick httptools now that it is installed.
    uvicorn_settings = {"loop": "uvloop", "http": "httptools"} if fast else {"http": "h11"}
    cfg = {"root": str(root), "socket": str(stub_socket), "run_dir": str(run_dir), "port": port,
           "engine_pid": args.stub_pid, "uvloop": fast, "uvicorn": uvicorn_settings}  # fmt: skip
    with (run_dir / "gateway.log").open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", BASELINE_LAUNCHER, json.dumps(cfg)], cwd=root, stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": ""})  # fmt: skip
    return RunningGateway(f"http://127.0.0.1:{port}", [proc.pid], lambda: stop_process(proc))


# The relays of the working tree, started and fed a table by the supervisor's relay pool; the stub is the engine.
RELAYS_LAUNCHER = r"""
import asyncio, json, signal, sys
from pathlib import Path

cfg = json.loads(sys.argv[1])
from app.metrics import SupervisorMetrics, use_directory

run_dir = Path(cfg["run_dir"])
use_directory(run_dir / "metrics", fresh=True)
from app.control import EngineRoute, RelaySettings, Table
from app.supervisor.relays import Relays, open_listener


async def main():
    async def admin(op, body):
        return 503, {"error": {"message": "no supervisor in this benchmark", "type": "service_unavailable"}}

    relays = Relays(run_dir, cfg["relays"], open_listener("127.0.0.1", cfg["port"]), 30.0, SupervisorMetrics(),
                    admin, lambda engine, why: None)
    settings = RelaySettings(admin_token="bench", max_body_bytes=8 * 2**20, queue_timeout=600, max_queue=100_000,
                             request_resumes=3)
    stub = EngineRoute(id=1, socket=cfg["socket"], capacity=1_000_000)
    await relays.start(Table(generation=1, active=stub, settings=settings))
    (run_dir / "relays.json").write_text(json.dumps([r["pid"] for r in relays.describe()]))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await relays.stop()

asyncio.run(main())
"""


def start_relays(stub_socket: Path, args: argparse.Namespace) -> RunningGateway:
    port = free_port()
    run_dir = stub_socket.parent
    cfg = {"socket": str(stub_socket), "run_dir": str(run_dir), "port": port, "relays": args.relays}
    with (run_dir / "gateway.log").open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", RELAYS_LAUNCHER, json.dumps(cfg)], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + 60
    while not (run_dir / "relays.json").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc)
            raise RuntimeError(f"the relays did not start: {tail(run_dir / 'gateway.log')}")
        time.sleep(0.05)
    pids = json.loads((run_dir / "relays.json").read_text())
    return RunningGateway(f"http://127.0.0.1:{port}", pids, lambda: stop_process(proc, grace=40.0))


GATEWAYS: dict[str, GatewayFactory] = {
    "baseline": start_baseline,
    "baseline-uvloop": lambda stub_socket, args: start_baseline(stub_socket, args, fast=True),
    "relays": start_relays,
}


# --- processes and their CPU ---------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the command name in parentheses may hold spaces
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of proc(5), counted from 1


def machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs together, from /proc/stat."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def stop_process(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_stub(sock: Path, step_ms: float, args: argparse.Namespace) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, str(ROOT / "bench" / "stub_engine.py"), "--socket", str(sock), "--step-ms",
           str(step_ms), "--sndbuf", str(args.stub_sndbuf)]  # fmt: skip
    with (sock.parent / "stub.log").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the stub exited with {proc.returncode}: {tail(sock.parent / 'stub.log')}")
        with contextlib.suppress(OSError):
            if uds_get(sock, "/health")["status"] == "ok":
                return proc
        if time.monotonic() > deadline:
            raise RuntimeError("the stub did not answer /health within 20 s")
        time.sleep(0.05)


def uds_get(sock: Path, path: str) -> dict[str, Any]:
    """A GET to the stub over its Unix socket (its own counters, its health)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(str(sock))
        s.sendall(f"GET {path} HTTP/1.1\r\nhost: stub\r\nconnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return cast(dict[str, Any], json.loads(data.split(b"\r\n\r\n", 1)[1]))


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# --- the load client (runs in its own processes) -------------------------------------------------------------------


class BadResponse(Exception):
    pass


class ClientConnection(asyncio.Protocol):
    """One keep-alive connection to the gateway, as an asyncio protocol: a response at a time, parsed as it comes.

    Chunked, content-length and close-delimited bodies; SSE events split on blank lines and classified by
    their first bytes, so a token event costs a few ``startswith``/``in`` tests, not a JSON parse.
    """

    HEAD, CHUNK_SIZE, CHUNK_DATA, TRAILER, LENGTH, UNTIL_CLOSE = range(6)

    def __init__(self, client: LoadClient) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.buf = bytearray()
        self.waiter: asyncio.Future[str | None] | None = None
        self.reset()

    def reset(self) -> None:
        self.state = self.HEAD
        self.status = 0
        self.sse = False
        self.close_after = False
        self.remaining = 0
        self.events = bytearray()
        self.body = bytearray()
        self.tokens = 0
        self.usage: int | None = None
        self.done = False
        self.error: str | None = None
        self.sent_at = 0.0
        self.first_at = 0.0

    def request(self) -> asyncio.Future[str | None]:
        """Send the client's request; the future gives None (ok) or why the response failed."""
        self.reset()
        self.waiter = asyncio.get_running_loop().create_future()
        self.sent_at = time.perf_counter()
        assert self.transport is not None
        self.transport.write(self.client.request_bytes)
        return self.waiter

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        before = self.tokens
        try:
            self.parse()
        except (BadResponse, ValueError, IndexError) as exc:
            self.finish(f"bad response: {exc}")
        counters = self.client.counters
        counters[READS] += 1
        if self.tokens > before:
            counters[TOKENS] += self.tokens - before

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            if self.state == self.UNTIL_CLOSE:
                self.complete()
            else:
                self.finish("the connection closed mid-response" if self.state != self.HEAD or self.buf
                            else "the connection closed before a response")  # fmt: skip

    def pause_writing(self) -> None:
        pass

    def resume_writing(self) -> None:
        pass

    # -- parsing ------------------------------------------------------------------------------

    def parse(self) -> None:
        buf, pos = self.buf, 0
        try:
            while self.waiter is not None and not self.waiter.done():
                if self.state == self.HEAD:
                    end = buf.find(b"\r\n\r\n", pos)
                    if end < 0:
                        return
                    self.head(bytes(buf[pos:end]).decode("latin-1"))
                    pos = end + 4
                elif self.state == self.CHUNK_SIZE:
                    end = buf.find(b"\r\n", pos)
                    if end < 0:
                        return
                    size = int(bytes(buf[pos:end]).split(b";", 1)[0], 16)
                    pos = end + 2
                    self.state, self.remaining = (self.TRAILER, 0) if size == 0 else (self.CHUNK_DATA, size)
                elif self.state == self.CHUNK_DATA:
                    if len(buf) - pos < self.remaining + 2:
                        return
                    end = pos + self.remaining
                    if buf[end : end + 2] != b"\r\n":
                        raise BadResponse("a chunk does not end in CRLF")
                    self.payload(buf[pos:end])
                    pos, self.state = end + 2, self.CHUNK_SIZE
                elif self.state == self.TRAILER:
                    end = buf.find(b"\r\n", pos)
                    if end < 0:
                        return
                    blank = end == pos
                    pos = end + 2
                    if blank:
                        self.complete()
                elif self.state == self.LENGTH:
                    take = min(self.remaining, len(buf) - pos)
                    self.payload(buf[pos : pos + take])
                    pos += take
                    self.remaining -= take
                    if self.remaining:
                        return
                    self.complete()
                else:  # UNTIL_CLOSE
                    self.payload(buf[pos:])
                    pos = len(buf)
                    return
        finally:
            del buf[:pos]

    def head(self, head: str) -> None:
        lines = head.split("\r\n")
        self.status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip().lower()
        self.close_after = headers.get("connection") == "close"
        self.sse = self.status == 200 and headers.get("content-type", "").startswith("text/event-stream")
        if "chunked" in headers.get("transfer-encoding", ""):
            self.state = self.CHUNK_SIZE
        elif "content-length" in headers:
            self.state, self.remaining = self.LENGTH, int(headers["content-length"])
            if self.remaining == 0:
                self.complete()
        else:
            self.state, self.close_after = self.UNTIL_CLOSE, True

    def payload(self, data: bytearray) -> None:
        if not self.sse:
            if len(self.body) < 400:
                self.body += data
            return
        events = self.events
        events += data
        start = 0
        while (end := events.find(b"\n\n", start)) >= 0:
            self.event(bytes(events[start:end]))
            start = end + 2
        del events[:start]

    def event(self, event: bytes) -> None:
        if self.done:
            self.error = self.error or f"an event after [DONE]: {event[:80]!r}"
        elif not event.startswith(b"data: "):
            # The gateway must strip the engine's internal ": warmgate" comments; nothing else sends comments.
            self.error = self.error or f"a non-data event reached the client: {event[:80]!r}"
        elif b"\n" in event:
            self.error = self.error or f"a multi-line event (an internal comment relayed?): {event[:120]!r}"
        elif event == b"data: [DONE]":
            self.done = True
        elif event.startswith(b'data: {"error"'):
            self.error = self.error or f"error event: {event[6:200].decode(errors='replace')}"
        elif b'"choices":[{' in event and b'"text":"' in event:
            self.tokens += 1
            if not self.first_at:
                self.first_at = time.perf_counter()
        elif b'"usage":{' in event:
            self.usage = json.loads(event[6:])["usage"]["completion_tokens"]
        else:
            self.error = self.error or f"an unexpected event: {event[:120]!r}"

    def complete(self) -> None:
        """The response has ended: its verdict."""
        expected = self.client.max_tokens
        if self.status != 200:
            why = f"HTTP {self.status}: {bytes(self.body[:200]).decode(errors='replace')}"
        elif not self.sse:
            why = "HTTP 200 but not an event stream"
        elif self.error is not None:
            why = self.error
        elif not self.done:
            why = "the stream ended without data: [DONE]"
        elif self.tokens != expected:
            why = f"{self.tokens} token events, not {expected}"
        elif self.usage != expected:
            why = f"usage.completion_tokens {self.usage}, not {expected}"
        else:
            why = None
        if why is None:
            self.client.latency(self.sent_at, self.first_at)
        self.finish(why)

    def finish(self, why: str | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(why)
        if why is not None and self.transport is not None:
            self.transport.close()  # the connection's state is unknown after a failure: start afresh


@dataclass
class LoadClient:
    """One client process's streams, counters (shared with the orchestrator) and what it saw fail."""

    host: str
    port: int
    streams: int
    max_tokens: int
    counters: Any  # a multiprocessing RawArray of int64, slots TOKENS..STOP
    request_bytes: bytes = b""
    stopping: bool = False
    reasons: dict[int, Counter[str]] = field(default_factory=lambda: {p: Counter() for p in (WARMUP, WINDOW, AFTER)})
    first_failures: list[tuple[int, float, str]] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)  # window: request seconds, ok requests
    ttfts: list[float] = field(default_factory=list)  # window: seconds to the first token, ok requests

    def __post_init__(self) -> None:
        body = json.dumps({"prompt": "hi", "max_tokens": self.max_tokens, "stream": True,
                           "stream_options": {"include_usage": True}, "ignore_eos": True,
                           "temperature": 0}).encode()  # fmt: skip
        head = (f"POST /v1/completions HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n")  # fmt: skip
        self.request_bytes = head.encode() + body

    def latency(self, sent_at: float, first_at: float) -> None:
        if self.counters[PHASE] == WINDOW:
            now = time.perf_counter()
            self.latencies.append(now - sent_at)
            self.ttfts.append(first_at - sent_at)

    def failed(self, why: str) -> None:
        phase = int(self.counters[PHASE])
        self.counters[FAILED] += 1
        self.reasons[phase][why[:160]] += 1
        if len(self.first_failures) < 20:
            self.first_failures.append((phase, time.time(), why[:300]))

    async def stream(self) -> None:
        """One client stream: requests back to back, on one connection while the gateway keeps it open."""
        loop = asyncio.get_running_loop()
        conn: ClientConnection | None = None
        while not self.stopping:
            if conn is None or conn.closed:
                try:
                    _, conn = await loop.create_connection(lambda: ClientConnection(self), self.host, self.port)
                except OSError as exc:
                    self.failed(f"connect: {exc}")
                    await asyncio.sleep(0.1)
                    continue
            why = await conn.request()
            if why is None:
                self.counters[OK] += 1
                if conn.close_after and conn.transport is not None:
                    conn.transport.close()
                    conn = None
            elif not self.stopping:
                self.failed(why)
                conn = None
                await asyncio.sleep(0.05)  # a failing gateway must not turn the client into a busy loop

    async def run(self) -> None:
        tasks = [asyncio.create_task(self.stream()) for _ in range(self.streams)]
        while not self.counters[STOP]:
            await asyncio.sleep(0.05)
        self.stopping = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def client_main(url: str, streams: int, max_tokens: int, counters: Any, results: PipeEnd) -> None:
    """A client process: ``streams`` streams until the orchestrator sets STOP, then what failed, through the pipe."""
    import uvloop

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    host, port = url.removeprefix("http://").rsplit(":", 1)
    client = LoadClient(host, int(port), streams, max_tokens, counters)
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(client.run())
    results.send({"reasons": {p: dict(c) for p, c in client.reasons.items()},
                  "first_failures": client.first_failures, "latencies": client.latencies,
                  "ttfts": client.ttfts})  # fmt: skip
    results.close()


# --- one row: a gateway under load ---------------------------------------------------------------------------------


def check_stream(url: str, max_tokens: int) -> None:
    """One streamed request through the gateway, checked before the load starts (a wrong stub shows here)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            conn.request("GET", "/health")
            health = conn.getresponse()
            health.read()
            if health.status == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway at {url} did not answer /health within 30 s")
        time.sleep(0.1)
    body = {"prompt": "hi", "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    response = conn.getresponse()
    text = response.read()
    events = [e for e in text.split(b"\n\n") if e]
    tokens = sum(1 for e in events if b'"choices":[{' in e)
    if response.status != 200 or events[-1:] != [b"data: [DONE]"] or tokens != max_tokens or b": warmgate" in text:
        raise RuntimeError(f"a streamed request through the gateway answered {response.status}: {text[:600]!r}")
    conn.close()


@dataclass
class Snapshot:
    at: float
    gateway_cpu: float
    stub_cpu: float
    client_cpu: float
    counters: list[int]  # TOKENS..READS summed over client processes
    machine: tuple[int, int]
    stub: dict[str, Any]


def snapshot(gateway: RunningGateway, stub: subprocess.Popen[bytes], clients: list[Any], arrays: list[Any],
             stub_socket: Path) -> Snapshot:  # fmt: skip
    # The gateway's counters and the tokens are read back to back: what falls between them is microseconds.
    gateway_cpu = sum(cpu_seconds(pid) for pid in gateway.pids)
    counters = [sum(int(a[slot]) for a in arrays) for slot in (TOKENS, OK, FAILED, READS)]
    at = time.monotonic()
    return Snapshot(at, gateway_cpu, cpu_seconds(stub.pid), sum(cpu_seconds(c.pid) for c in clients), counters,
                    machine_ticks(), uds_get(stub_socket, "/stub/stats"))  # fmt: skip


class Timeline:
    """Once a second from the load's start: seconds, tokens received so far, the gateway's CPU seconds so far.

    It also places the window. Connecting a burst of new streams can cost a gateway far more than streaming
    (a queue scanned per request, say): the warm-up lasts ``warmup`` seconds from the first token received,
    not from the load's start. A gateway that streams in waves (a connection pool serving a hundred streams
    at a time while the rest wait) needs a window of several waves: it lasts at least ``window`` seconds
    and until ``tokens`` tokens have come.
    """

    def __init__(self, gateway: RunningGateway, arrays: list[Any], clients: list[Any]) -> None:
        self.gateway, self.arrays, self.clients = gateway, arrays, clients
        self.started = time.monotonic()
        self.first_token: float | None = None  # seconds from the load's start
        self.samples: list[tuple[float, int, float]] = []
        self.sample()

    def tokens(self) -> int:
        return sum(int(a[TOKENS]) for a in self.arrays)

    def sample(self) -> None:
        dead = [c.pid for c in self.clients if not c.is_alive()]
        if dead:
            raise RuntimeError(f"client process(es) {dead} exited during the run")
        cpu = sum(cpu_seconds(pid) for pid in self.gateway.pids)
        tokens = self.tokens()
        at = time.monotonic() - self.started
        if tokens and self.first_token is None:
            self.first_token = at
        self.samples.append((round(at, 2), tokens, round(cpu, 2)))

    def run_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(1.0, left))
            self.sample()

    def warm_up(self, seconds: float, most: float) -> bool:
        """``seconds`` of streaming after the first token (at most ``most`` from the start): whether tokens came."""
        while self.first_token is None and time.monotonic() - self.started < most:
            self.run_for(min(1.0, most - (time.monotonic() - self.started)))
        if self.first_token is None:
            return False
        self.run_for(min(self.started + self.first_token + seconds, self.started + most) - time.monotonic())
        return True

    def window(self, seconds: float, tokens: int, most: float) -> None:
        """At least ``seconds``, then until ``tokens`` more tokens have come, at most ``most`` seconds."""
        start, at_start = time.monotonic(), self.tokens()
        self.run_for(seconds)
        while self.tokens() - at_start < tokens and time.monotonic() - start < most:
            self.run_for(min(1.0, most - (time.monotonic() - start)))


def percentile(samples: list[float], q: float) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_row(mode: str, streams: int, step_ms: float, args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="relay-cpu-"))
    stub_socket = work / "stub.sock"
    stub = start_stub(stub_socket, step_ms, args)
    args.stub_pid = stub.pid
    gateway: RunningGateway | None = None
    ctx = multiprocessing.get_context("spawn")
    clients: list[Any] = []
    arrays: list[Any] = []
    pipes: list[PipeEnd] = []
    try:
        gateway = GATEWAYS[mode](stub_socket, args)
        try:
            check_stream(gateway.url, args.max_tokens)
        except Exception:
            print(f"{work}/gateway.log:\n{tail(work / 'gateway.log')}", file=sys.stderr)
            raise
        procs = max(1, min(args.client_procs, streams))
        for i in range(procs):
            share = streams // procs + (1 if i < streams % procs else 0)
            counters = ctx.RawArray("q", 6)
            receive, send = ctx.Pipe(duplex=False)
            client = ctx.Process(target=client_main, args=(gateway.url, share, args.max_tokens, counters, send),
                                 daemon=True)  # fmt: skip
            client.start()
            send.close()
            clients.append(client)
            arrays.append(counters)
            pipes.append(receive)
        timeline = Timeline(gateway, arrays, clients)
        if not timeline.warm_up(args.warmup, args.warmup_max):
            raise RuntimeError(f"no token reached a client within {args.warmup_max} s")
        start = snapshot(gateway, stub, clients, arrays, stub_socket)
        for a in arrays:
            a[PHASE] = WINDOW
        window_tokens = args.window_tokens if args.window_tokens is not None else 2 * streams * args.max_tokens
        timeline.window(args.window, window_tokens, args.window_max)
        end = snapshot(gateway, stub, clients, arrays, stub_socket)
        for a in arrays:
            a[PHASE] = AFTER
            a[STOP] = 1
        reports = []
        for client, pipe in zip(clients, pipes, strict=True):
            with contextlib.suppress(EOFError):
                if pipe.poll(30):
                    reports.append(pipe.recv())
            client.join(10)
        if len(reports) < len(clients):
            raise RuntimeError(f"{len(clients) - len(reports)} client process(es) did not report")
    finally:
        for client in clients:
            if client.is_alive():
                client.terminate()
        if gateway is not None:
            gateway.stop()
        stop_process(stub)
    shutil.rmtree(work, ignore_errors=True)  # kept when the row failed: the stub's and the gateway's logs
    result = row(mode, streams, args, gateway, start, end, reports)
    result["step_ms"] = step_ms
    result["first_token_s"] = timeline.first_token
    result["warmup_s"] = round(start.at - timeline.started, 1)
    result["timeline"] = timeline.samples
    return result


def row(mode: str, streams: int, args: argparse.Namespace, gateway: RunningGateway, start: Snapshot, end: Snapshot,
        reports: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    seconds = end.at - start.at
    tokens, ok, failed, reads = (e - s for e, s in zip(end.counters, start.counters, strict=True))
    gateway_cpu = end.gateway_cpu - start.gateway_cpu
    busy = (end.machine[0] - start.machine[0]) / max(1, end.machine[1] - start.machine[1])
    ours = gateway_cpu + end.stub_cpu - start.stub_cpu + end.client_cpu - start.client_cpu
    reasons: Counter[str] = Counter()
    for report in reports:
        reasons.update(report["reasons"].get(WINDOW, {}))
    latencies = [x for r in reports for x in r["latencies"]]
    ttfts = [x for r in reports for x in r["ttfts"]]
    stub_events = end.stub["events"] - start.stub["events"]
    stub_skipped = end.stub["skipped"] - start.stub["skipped"]
    return {
        "mode": mode,
        "streams": streams,
        "max_tokens": args.max_tokens,
        "window_s": round(seconds, 3),
        "tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
        "gateway_cpu_s": round(gateway_cpu, 3),
        "gateway_cores": round(gateway_cpu / seconds, 3),  # how much of a core the gateway kept busy
        "us_per_token": round(1e6 * gateway_cpu / tokens, 1) if tokens else None,
        "requests_ok": ok,
        "requests_failed": failed,
        "failure_reasons": dict(reasons.most_common(5)),
        "first_failures": [f for r in reports for f in r["first_failures"]][:5],
        "gateway_pids": len(gateway.pids),
        "stub_cpu_s": round(end.stub_cpu - start.stub_cpu, 3),
        "client_cpu_s": round(end.client_cpu - start.client_cpu, 3),
        "machine_busy": round(busy, 3),  # of all cores, 1.0 = every core busy the whole window
        # Cores kept busy by everything else on the machine (other jobs): the figures are CPU times, but a
        # loaded machine slows the gateway's wall clock and throughput, and its caches.
        "other_cores": round(busy * (os.cpu_count() or 1) - ours / seconds, 2),
        "client_tokens_per_read": round(tokens / reads, 2) if reads else None,
        "stub_events": stub_events,
        "stub_steps": end.stub["steps"] - start.stub["steps"],
        # Stream-steps the stub skipped because the gateway had not read the previous events yet.
        "stub_skipped_share": round(stub_skipped / max(1, stub_skipped + stub_events), 3),
        "latency_p50_s": percentile(latencies, 0.5),
        "latency_p99_s": percentile(latencies, 0.99),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "latency_mean_s": statistics.fmean(latencies) if latencies else None,
    }


def table(rows: list[dict[str, Any]]) -> str:
    columns = [("mode", "mode", "{}"), ("streams", "streams", "{}"), ("step_ms", "stub step ms", "{:g}"),
               ("tokens", "tokens in window", "{}"), ("window_s", "window s", "{:.1f}"),
               ("tokens_per_s", "tokens/s", "{:.0f}"), ("gateway_cpu_s", "gateway CPU s", "{:.2f}"),
               ("us_per_token", "us/token", "{:.1f}"), ("requests_failed", "failed", "{}"),
               ("gateway_pids", "gateway pids", "{}"), ("stub_cpu_s", "stub CPU s", "{:.2f}"),
               ("client_cpu_s", "client CPU s", "{:.2f}"), ("other_cores", "other jobs, cores", "{:.2f}"),
               ("ttft_p50_s", "TTFT p50 s", "{:.2f}")]  # fmt: skip
    lines = ["| " + " | ".join(title for _, title, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = [form.format(r[key]) if r.get(key) is not None else "-" for key, _, form in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["baseline", "baseline-uvloop"], choices=sorted(GATEWAYS))
    parser.add_argument("--streams", nargs="+", type=int, default=[1000])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of streaming (from the first token) "
                        "before the window")  # fmt: skip
    parser.add_argument("--warmup-max", type=float, default=180.0, help="most seconds from the load's start to the "
                        "window")  # fmt: skip
    parser.add_argument("--window", type=float, default=20.0, help="least seconds measured")
    parser.add_argument("--window-tokens", type=int, help="least tokens measured (default: 2 x streams x "
                        "max-tokens, two requests per stream)")  # fmt: skip
    parser.add_argument("--window-max", type=float, default=300.0, help="most seconds measured")
    parser.add_argument("--client-procs", type=int, default=1)
    parser.add_argument("--relays", type=int, default=2, help="relay workers in the relays mode (the default "
                        "on a machine of up to 23 cores)")  # fmt: skip
    parser.add_argument("--step-ms", nargs="+", type=float, default=[0.0],
                        help="the stub's step time, a row set for each; 0: as fast as it can")  # fmt: skip
    parser.add_argument("--stub-sndbuf", type=int, default=4096, help="SO_SNDBUF of the stub's connections")
    parser.add_argument("--baseline-dir", default="/tmp/wg-baseline", help=f"a copy of commit {BASELINE_COMMIT}")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "relay_cpu.json")
    args = parser.parse_args()
    rows = []
    for step_ms in args.step_ms:
        for streams in args.streams:
            for mode in args.modes:
                print(f"{mode}, {streams} streams, stub step {step_ms} ms ...", file=sys.stderr, flush=True)
                try:
                    r = run_row(mode, streams, step_ms, args)
                except Exception as exc:  # one gateway that breaks down still leaves the other rows
                    r = {"mode": mode, "streams": streams, "step_ms": step_ms, "error": f"{type(exc).__name__}: {exc}"}
                    print(f"  failed: {r['error']}", file=sys.stderr, flush=True)
                else:
                    print(f"  {r['tokens_per_s']} tokens/s, {r['us_per_token']} us/token, {r['requests_failed']} "
                          f"failed ({r['window_s']:.0f} s window)", file=sys.stderr, flush=True)  # fmt: skip
                rows.append(r)
    print(table(rows))
    for r in rows:
        for why, count in r.get("failure_reasons", {}).items():
            print(f"- {r['mode']}, {r['streams']} streams: {count} x {why}")
        if "error" in r:
            print(f"- {r['mode']}, {r['streams']} streams: no figure: {r['error']}")
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "stub_pid")}
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"head": commit, "baseline_commit": BASELINE_COMMIT, "cpus": os.cpu_count(),
                                    "settings": settings, "rows": rows}, indent=2, default=str) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
