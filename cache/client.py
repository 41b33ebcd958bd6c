"""Talk to a cache process: hello, manifest, attach (manifest + arena fds), release, stats.

An attachment keeps its connection open: the cache ties the lease to it, so an engine that
exits or is killed releases its lease without saying anything.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from cache.manifest import Manifest
from cache.protocol import PROTOCOL_VERSION, HelloReply, StatsReply
from common.framing import ProtocolError, recv_message, send_message


class CacheUnavailable(ConnectionError):
    """No cache process answers on the socket (not running, wrong path, no permission)."""


class CacheRefused(RuntimeError):
    """The cache answered with an error."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class CacheClient:
    def __init__(self, socket_path: Path, *, name: str = "", timeout: float = 10.0) -> None:
        self.socket_path = Path(socket_path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(str(self.socket_path))
        except (FileNotFoundError, ConnectionRefusedError, PermissionError) as exc:
            sock.close()
            raise CacheUnavailable(f"no cache process on {self.socket_path}: {exc.strerror or exc}") from None
        self._sock = sock
        try:
            self.hello = HelloReply.model_validate(self._call({"op": "hello", "protocol": PROTOCOL_VERSION,
                                                               "client": name})[0])  # fmt: skip
        except ValidationError as exc:
            self.close()
            raise CacheRefused("ProtocolError", f"the cache's hello is not understood: {exc}") from None
        except BaseException:
            self.close()
            raise

    def manifest(self) -> Manifest:
        return Manifest.from_json(self._call({"op": "manifest"})[0]["manifest"])

    def attach(self, engine: str = "") -> tuple[int, Manifest, list[int]]:
        """A lease id, the manifest and one fd per arena (the caller closes the fds once mapped)."""
        reply, fds = self._call({"op": "attach", "engine": engine})
        manifest = Manifest.from_json(reply["manifest"])
        if len(fds) != len(manifest.arenas):
            for fd in fds:
                os.close(fd)
            raise CacheRefused("ProtocolError", f"attach sent {len(fds)} fds for {len(manifest.arenas)} arenas")
        return int(reply["lease"]), manifest, fds

    def release(self, lease: int) -> None:
        self._call({"op": "release", "lease": lease})

    def stats(self) -> StatsReply:
        try:
            return StatsReply.model_validate(self._call({"op": "stats"})[0])
        except ValidationError as exc:
            raise CacheRefused("ProtocolError", f"the cache's stats are not understood: {exc}") from None

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        try:
            send_message(self._sock, request)
            received = recv_message(self._sock)
        except ProtocolError as exc:
            raise CacheRefused("ProtocolError", str(exc)) from None
        except OSError as exc:
            raise CacheUnavailable(f"cache on {self.socket_path} stopped answering: {exc}") from None
        if received is None:
            raise CacheUnavailable(f"cache on {self.socket_path} closed the connection")
        reply, fds = received
        if not reply.get("ok"):
            error = reply.get("error") or {}
            raise CacheRefused(str(error.get("type", "Error")), str(error.get("message", reply)))
        return reply, fds
