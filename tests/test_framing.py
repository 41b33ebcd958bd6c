"""common/framing.py: the one framing of the cache, the fork server, the relays and the front's link."""

from __future__ import annotations

import asyncio
import math
import os
import socket
import struct

import pytest

from common.framing import MAX_MESSAGE_BYTES, ProtocolError, decode, encode, read_message, recv_message, send_message

VALUES = {
    "ids": list(range(0, 2000, 7)),
    "big": 10**30,
    "floats": [0.1, -0.0, 1e300, 2.5e-8],
    "text": 'héllo, 世界 \n "quoted" \\ \u2028',
    "path": "/models/\udcff-not-utf-8",  # os.fsdecode of a name that is not UTF-8: a lone surrogate
    "nested": {"a": [None, True, False, {"b": []}]},
}


def test_messages_cross_as_they_were() -> None:
    assert decode(encode(VALUES)) == VALUES
    special = decode(encode({"nan": math.nan, "inf": math.inf, "ninf": -math.inf}))
    assert math.isnan(special["nan"]) and special["inf"] == math.inf and special["ninf"] == -math.inf
    assert decode(encode({"t": (1, 2)})) == {"t": [1, 2]}


@pytest.mark.parametrize("body", [b"", b"\xff\xfe", b"[1, 2]", b'"text"', b'{"a": 1} trailing', b"{" * 5000])
def test_what_is_not_a_json_object_is_a_protocol_error(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(body)


def test_a_message_json_cannot_encode_is_refused() -> None:
    with pytest.raises((TypeError, ValueError)):
        encode({"x": object()})


def test_blocking_sockets_carry_messages_and_fds() -> None:
    left, right = socket.socketpair()
    read_end, write_end = os.pipe()
    try:
        send_message(left, VALUES, fds=[read_end])
        send_message(left, {"second": 2})
        received = recv_message(right)
        assert received is not None
        message, fds = received
        assert message == VALUES and len(fds) == 1
        os.write(write_end, b"x")
        assert os.read(fds[0], 1) == b"x"  # the same pipe, passed over the socket
        os.close(fds[0])
        assert recv_message(right) == ({"second": 2}, [])
        left.close()
        assert recv_message(right) is None  # a clean end of stream
    finally:
        for s in (left, right):
            s.close()
        os.close(read_end)
        os.close(write_end)


def test_oversized_and_truncated_frames_are_protocol_errors() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(struct.pack("!I", MAX_MESSAGE_BYTES + 1))
        with pytest.raises(ProtocolError, match="exceeds"):
            recv_message(right)

    async def truncated() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(struct.pack("!I", 10) + b'{"a"')
        reader.feed_eof()
        with pytest.raises(ProtocolError, match="closed after 4 of 10 bytes"):
            await read_message(reader)
        empty = asyncio.StreamReader()
        empty.feed_eof()
        assert await read_message(empty) is None

    asyncio.run(truncated())
