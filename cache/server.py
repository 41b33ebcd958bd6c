"""The cache process: hold one model's processed weights and hand them to engines on request.

``warmgate cache --model PATH --socket PATH --device auto|cpu|cuda[:i]`` loads, validates,
processes and packs the checkpoint (cache/loader.py), and only then binds its socket and
logs ``event=ready``. Each connection is served on its own thread. A lease lives as long as
the engine's connection: an engine that exits, crashes or is killed closes it, and its
lease is gone with it. SIGTERM stops accepting and exits; engines that attached keep
their mappings (the memory is freed when the last one unmaps it).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cache.protocol import (
    PROTOCOL_VERSION,
    Attach,
    GetManifest,
    Hello,
    HelloReply,
    LeaseInfo,
    Release,
    Stats,
    StatsReply,
    error_reply,
    parse_request,
)
from common import events
from common.framing import ProtocolError, recv_message, send_json, send_message
from common.proctitle import set_title
from common.uds import bind_unix_socket, peer_credentials, private_dir

if TYPE_CHECKING:
    from cache.loader import LoadedCache

log = logging.getLogger("warmgate.cache")


@dataclass
class Lease:
    id: int
    pid: int
    engine: str
    since: float


class CacheServer:
    def __init__(self, cache: LoadedCache, socket_path: Path) -> None:
        self.cache = cache
        self.socket_path = socket_path
        self.started = time.monotonic()
        self.attach_count = 0
        self.leases: dict[int, Lease] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        # Encoded once: serialising the manifest took 14 ms of every attach (the demo, 182 tensors).
        self._manifest_json = json.dumps(cache.manifest.to_json(), separators=(",", ":")).encode()

    def bind(self) -> None:
        self._listener = bind_unix_socket(self.socket_path, private=True)
        self._listener.settimeout(0.2)  # so serve_forever notices stop()

    def serve_forever(self) -> None:
        if self._listener is None:
            self.bind()
        assert self._listener is not None
        try:
            while not self._stop.is_set():
                try:
                    conn, _ = self._listener.accept()
                except TimeoutError:
                    continue
                conn.settimeout(None)
                threading.Thread(target=self._serve_connection, args=(conn,), daemon=True).start()
        finally:
            self._listener.close()
            self.socket_path.unlink(missing_ok=True)

    def stop(self) -> None:
        self._stop.set()

    # -- one connection ------------------------------------------------------------------

    def _serve_connection(self, conn: socket.socket) -> None:
        peer = peer_credentials(conn)
        owned: set[int] = set()
        try:
            if peer.uid != os.getuid():
                events.log_event(log, "refused", peer_pid=peer.pid, peer_uid=peer.uid, reason="uid")
                send_message(conn, error_reply("PeerRefused", f"uid {peer.uid} may not use this cache"))
                _lingering_close(conn)  # let the peer read why, rather than fail on a reset
                return
            while True:
                try:
                    received = recv_message(conn)
                except ProtocolError as exc:
                    events.log_event(log, "bad_message", peer_pid=peer.pid, reason=exc)
                    send_message(conn, error_reply("ProtocolError", str(exc)))
                    _lingering_close(conn)  # the framing cannot be trusted any more
                    return
                if received is None:
                    return
                message, fds = received
                for fd in fds:  # engines send no descriptors; do not leak what a peer pushes
                    os.close(fd)
                self._dispatch(conn, message, peer.pid, owned)
        except OSError:
            pass  # the peer went away mid-message
        finally:
            with self._lock:
                for lease_id in owned:
                    lease = self.leases.pop(lease_id, None)
                    if lease is not None:
                        events.log_event(log, "lease_end", lease=lease.id, pid=lease.pid, reason="disconnect")
            with contextlib.suppress(OSError):
                conn.close()

    def _dispatch(self, conn: socket.socket, message: dict[str, Any], pid: int, owned: set[int]) -> None:
        try:
            request = parse_request(message)
        except ValueError as exc:
            send_message(conn, error_reply("BadRequest", str(exc)))
            return
        manifest = self.cache.manifest
        if isinstance(request, Hello):
            if request.protocol != PROTOCOL_VERSION:
                reason = f"protocol {request.protocol}, this cache speaks {PROTOCOL_VERSION}"
                send_message(conn, error_reply("VersionMismatch", reason))
                return
            hello = HelloReply(
                ok=True,
                protocol=PROTOCOL_VERSION,
                key=manifest.key,
                pid=os.getpid(),
                model=manifest.model,
                device=manifest.device,
                backend=manifest.backend,
            )
            send_message(conn, hello.model_dump())
        elif isinstance(request, GetManifest):
            send_json(conn, b'{"ok":true,"manifest":' + self._manifest_json + b"}")
        elif isinstance(request, Attach):
            fds = [arena.export_fd() for arena in self.cache.arenas]
            with self._lock:
                lease = Lease(next(self._ids), pid, request.engine, time.time())
                self.leases[lease.id] = lease
                self.attach_count += 1
            owned.add(lease.id)
            try:
                send_json(conn, b'{"ok":true,"lease":%d,"manifest":%b}' % (lease.id, self._manifest_json), fds)
            finally:
                for fd in fds:
                    os.close(fd)
            events.log_event(log, "attach", lease=lease.id, pid=pid, engine=request.engine or "-")
        elif isinstance(request, Release):
            with self._lock:
                found = request.lease in owned and self.leases.pop(request.lease, None) is not None
            if not found:
                send_message(conn, error_reply("UnknownLease", f"lease {request.lease} is not held by this connection"))
                return
            owned.discard(request.lease)
            events.log_event(log, "lease_end", lease=request.lease, pid=pid, reason="release")
            send_message(conn, {"ok": True})
        elif isinstance(request, Stats):
            send_message(conn, self.stats().model_dump())

    def stats(self) -> StatsReply:
        manifest = self.cache.manifest
        with self._lock:
            leases = [LeaseInfo(id=lease.id, pid=lease.pid, engine=lease.engine, since=lease.since)
                      for lease in self.leases.values()]  # fmt: skip
            attach_count = self.attach_count
        return StatsReply(
            ok=True,
            key=manifest.key,
            model=manifest.model,
            device=manifest.device,
            bytes=manifest.nbytes,
            tensors=len(manifest.tensors),
            arenas=len(manifest.arenas),
            leases=leases,
            attach_count=attach_count,
            uptime_s=time.monotonic() - self.started,
            pid=os.getpid(),
        )


def _lingering_close(conn: socket.socket, limit: int = 1 << 20) -> None:
    """Stop sending, then read what the peer still sends (briefly) so the close does not reset the
    connection before the peer has read our error reply."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(1.0)
        received = 0
        while received < limit:
            data = conn.recv(65536)
            if not data:
                break
            received += len(data)


def main(model: Path, socket_path: Path, device: str = "auto", dtype: str = "auto", backend: str = "native") -> int:
    """Run the cache process until SIGTERM/SIGINT. Checkpoint errors propagate before the socket exists."""
    started = time.perf_counter()
    events.configure_logging()
    set_title(f"cache {Path(model).name} {socket_path.parent}")
    events.log_event(log, "startup", phase="begin", model=model, socket=socket_path, device=device, backend=backend,
                     pid=os.getpid())  # fmt: skip
    stop = threading.Event()
    server: CacheServer | None = None

    def on_signal(signum: int, _frame: Any) -> None:
        stop.set()
        if server is not None:
            server.stop()

    # Installed first: a SIGTERM while loading ends the process cleanly, with nothing half-served.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    private_dir(socket_path.parent)  # before the slow part: a wrong run dir fails in a second, not after loading
    t = time.perf_counter()
    import torch

    from cache.loader import load_cache
    from common.device import resolve_device

    events.log_event(log, "startup", phase="import", seconds=time.perf_counter() - t)
    t = time.perf_counter()
    target = resolve_device(device)
    if target.type == "cuda":
        torch.cuda.set_device(target)
    cache = load_cache(model, target, dtype, backend)
    events.log_event(log, "startup", phase="load", seconds=time.perf_counter() - t, **cache.phases)
    if stop.is_set():
        events.log_event(log, "exit", reason="signal during start-up")
        return 0
    server = CacheServer(cache, socket_path)
    server.bind()
    manifest = cache.manifest
    events.log_event(log, "ready", socket=socket_path, key=manifest.key, bytes=manifest.nbytes,
                     tensors=len(manifest.tensors), arenas=len(manifest.arenas),
                     seconds=time.perf_counter() - started)  # fmt: skip
    if stop.is_set():
        server.stop()
    server.serve_forever()
    events.log_event(log, "exit", attach_count=server.attach_count, seconds=time.perf_counter() - started)
    return 0
