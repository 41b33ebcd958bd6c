"""The cache socket protocol: its requests and replies, framed by common/framing.py (length-prefixed JSON,
arena fds beside them with SCM_RIGHTS; no pickle: a peer can at worst send a request the schema refuses).

Requests (``op``): hello, manifest, attach, release, stats. Replies: ``{"ok": true, ...}`` (``HelloReply``,
``StatsReply``; the manifest's own schema for manifest and attach) or ``{"ok": false, "error": {"type": ...,
"message": ...}}``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

PROTOCOL_VERSION = 1


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


class _Reply(BaseModel):
    model_config = ConfigDict(extra="ignore")  # a newer cache may say more

    ok: Literal[True]


class HelloReply(_Reply):
    protocol: int
    key: str
    pid: int
    model: str
    device: str
    backend: str = "native"


class LeaseInfo(BaseModel):
    id: int
    pid: int
    engine: str
    since: float


class StatsReply(_Reply):
    key: str
    model: str
    device: str
    bytes: int
    tensors: int
    arenas: int
    leases: list[LeaseInfo]
    attach_count: int
    uptime_s: float
    pid: int
