"""The cache socket protocol: length-prefixed JSON messages, arena fds beside them (SCM_RIGHTS).

Frame: a 4-byte big-endian length, then that many bytes of UTF-8 JSON (an object). File
descriptors ride on the frame's first byte. No pickle: a peer can at worst send a request
the schema refuses.

Requests (``op``): hello, manifest, attach, release, stats. Replies: ``{"ok": true, ...}`` or
``{"ok": false, "error": {"type": ..., "message": ...}}``.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import socket
import struct
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a 70B manifest is well under 1 MB
MAX_FDS = 16
_HEADER = struct.Struct("!I")


class ProtocolError(Exception):
    """The peer sent something that is not a valid message; the connection cannot continue."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Hello(_Request):
    op: Literal["hello"]
    protocol: int
    client: str = ""  # who is asking, for logs


class GetManifest(_Request):
    op: Literal["manifest"]


class Attach(_Request):
    op: Literal["attach"]
    engine: str = ""  # a name for the lease (the engine's socket, say)


class Release(_Request):
    op: Literal["release"]
    lease: int


class Stats(_Request):
    op: Literal["stats"]


Request = Annotated[Hello | GetManifest | Attach | Release | Stats, Field(discriminator="op")]
_REQUEST = TypeAdapter(Request)


def parse_request(message: dict[str, Any]) -> Hello | GetManifest | Attach | Release | Stats:
    """A validated request; ValueError with a readable reason otherwise."""
    try:
        return _REQUEST.validate_python(message)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "message"
        raise ValueError(f"invalid request: {where}: {first['msg']}") from None


def error_reply(kind: str, message: str) -> dict[str, Any]:
    return {"ok": False, "error": {"type": kind, "message": message}}


def send_message(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    send_json(sock, json.dumps(message, separators=(",", ":")).encode(), fds)


def send_json(sock: socket.socket, body: bytes, fds: list[int] | None = None) -> None:
    """Send an already-encoded JSON object (the cache pre-encodes its manifest once)."""
    frame = _HEADER.pack(len(body)) + body
    if fds:
        sent = socket.send_fds(sock, [frame], fds)
        if sent < len(frame):
            sock.sendall(frame[sent:])
    else:
        sock.sendall(frame)


def recv_message(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """The next message and the fds that came with it; None on a clean end of stream."""
    fds: list[int] = []
    header = _recv_exact(sock, _HEADER.size, fds, allow_eof=True)
    if header is None:
        return None
    (length,) = _HEADER.unpack(header)
    if length > MAX_MESSAGE_BYTES:
        _close_all(fds)
        raise ProtocolError(f"message of {length} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    body = _recv_exact(sock, length, fds, allow_eof=False) or b""
    try:
        message = json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        _close_all(fds)
        raise ProtocolError(f"message is not JSON: {exc}") from None
    if not isinstance(message, dict):
        _close_all(fds)
        raise ProtocolError("message is not a JSON object")
    return message, fds


def _recv_exact(sock: socket.socket, n: int, fds: list[int], *, allow_eof: bool) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        data, ancdata, _flags, _addr = sock.recvmsg(n - got, socket.CMSG_SPACE(MAX_FDS * 4))
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                received = array.array("i")
                received.frombytes(payload[: len(payload) - len(payload) % received.itemsize])
                fds.extend(received)
        if not data:
            if allow_eof and got == 0:
                return None
            _close_all(fds)
            raise ProtocolError(f"connection closed after {got} of {n} bytes")
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()
