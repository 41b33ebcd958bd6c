"""Length-prefixed JSON messages over Unix sockets: the one framing of the cache, the fork server and the relays.

Frame: a 4-byte big-endian length, then that many bytes of UTF-8 JSON (an object). No pickle: a peer can
at worst send a message its schema refuses. File descriptors (the cache's arenas) ride on a frame's first
byte (SCM_RIGHTS). Blocking sockets use ``send_message``/``recv_message``; asyncio streams use
``write_message``/``read_message``.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import socket
import struct
from typing import Any

from common import json_codec

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a 70B manifest is well under 1 MB
MAX_FDS = 16
HEADER = struct.Struct("!I")


class ProtocolError(Exception):
    """The peer sent something that is not a valid message; the connection cannot continue."""


def encode(message: dict[str, Any]) -> bytes:
    """The JSON body of a message (compact)."""
    return json_codec.dumps(message)


def frame(body: bytes) -> bytes:
    """A whole frame around an encoded body."""
    return HEADER.pack(len(body)) + body


def decode(body: bytes) -> dict[str, Any]:
    """A message from its body; ProtocolError unless it is a JSON object."""
    try:
        message = json_codec.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"message is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError("message is not a JSON object")
    return message


def _checked_length(header: bytes) -> int:
    (length,) = HEADER.unpack(header)
    if length > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {length} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    return int(length)


# -- blocking sockets (the cache process, the fork server) ------------------------------------------------


def send_message(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    send_json(sock, encode(message), fds)


def send_json(sock: socket.socket, body: bytes, fds: list[int] | None = None) -> None:
    """Send an already-encoded JSON object (the cache pre-encodes its manifest once)."""
    data = frame(body)
    if fds:
        sent = socket.send_fds(sock, [data], fds)
        if sent < len(data):
            sock.sendall(data[sent:])
    else:
        sock.sendall(data)


def recv_message(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """The next message and the fds that came with it; None on a clean end of stream."""
    fds: list[int] = []
    header = _recv_exact(sock, HEADER.size, fds, allow_eof=True)
    if header is None:
        return None
    try:
        length = _checked_length(header)
        body = _recv_exact(sock, length, fds, allow_eof=False) or b""
        return decode(body), fds
    except ProtocolError:
        _close_all(fds)
        raise


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


# -- asyncio streams (the supervisor's side of the fork server, the relays' control channel) ---------------


async def read_message(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """The next message; None on a clean end of stream (ProtocolError or IncompleteReadError otherwise)."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ProtocolError(f"connection closed after {len(exc.partial)} bytes of a header") from None
    length = _checked_length(header)
    try:
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError(f"connection closed after {len(exc.partial)} of {length} bytes") from None
    return decode(body)


def write_message(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    """Queue a message on the stream (``await writer.drain()`` to wait for it to leave)."""
    writer.write(frame(encode(message)))
