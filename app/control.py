"""Every message between the supervisor and its relays, one typed struct each (replies too).

The control channel is a Unix socket in the run dir (``control.sock``, 0600 in a 0700 directory), framed by
common/framing.py (length-prefixed JSON). Each relay holds one connection:

    relay -> supervisor   RelayHello, TableApplied, EngineFailure, AdminCall
    supervisor -> relay   Table, AdminReply

The supervisor pushes the whole table whenever routing or relay settings change; a relay acknowledges
each generation (the supervisor waits for those acks before it drains an engine it switched away from, so
no relay sends new requests to an engine that began draining). Relays never ask for the table: they keep
serving with the last one they got, whatever the supervisor is doing, and when the channel closes (the
supervisor died) they connect again until a supervisor answers: a new one adopts them by their hello.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

ADMIN_OPS = ("restart", "reload", "status")


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineRoute(_Message):
    """Where a relay sends requests for one engine, and how many the relays may have there at once, together (its
    max_num_seqs plus the backlog; app/relay/board.py counts them)."""

    id: int
    socket: str
    capacity: int


class RelaySettings(_Message):
    """What a relay needs of the gateway's settings (a reload changes them at once)."""

    api_keys: list[str] = []
    admin_token: str
    max_body_bytes: int
    queue_timeout: float  # seconds a request waits for an engine slot before 503
    max_queue: int  # requests waiting in one relay before 503
    request_resumes: int  # moves of one request to another engine after its failed


class Table(_Message):
    """The relays' whole world: where to send requests, and with which limits. ``generation`` grows by one
    at every change."""

    kind: Literal["table"] = "table"
    generation: int
    active: EngineRoute | None
    standbys: list[EngineRoute] = []
    draining: list[EngineRoute] = []
    cache_down: str | None = None  # why the cache process is not serving, while it is restarted
    settings: RelaySettings


class AdminReply(_Message):
    kind: Literal["admin_reply"] = "admin_reply"
    id: int
    status: int
    body: dict[str, Any]


class RelayHello(_Message):
    """A relay's first message on every connection: a new supervisor adopts the relays that say hello."""

    kind: Literal["hello"] = "hello"
    relay: int  # the relay's slot (its place on the admission board)
    pid: int
    generation: int = -1  # the generation of the table it serves with (-1: none yet)
    listener: int = 0  # the inode of the listening socket it accepts on (common/handoff.py identity)


class TableApplied(_Message):
    kind: Literal["applied"] = "applied"
    generation: int


class EngineFailure(_Message):
    """A relay saw an engine fail a request (its socket errored, or the stream was cut): the supervisor checks
    the engine and replaces it if it is dead or hung."""

    kind: Literal["engine_failed"] = "engine_failed"
    engine: int
    why: str


class AdminCall(_Message):
    """An admin request a relay received (already authorized) for the supervisor to carry out."""

    kind: Literal["admin"] = "admin"
    id: int
    op: Literal["restart", "reload", "status"]
    body: dict[str, Any] = {}


ToRelay = Annotated[Table | AdminReply, Field(discriminator="kind")]
ToSupervisor = Annotated[RelayHello | TableApplied | EngineFailure | AdminCall, Field(discriminator="kind")]
_TO_RELAY: TypeAdapter[Table | AdminReply] = TypeAdapter(ToRelay)
_TO_SUPERVISOR: TypeAdapter[RelayHello | TableApplied | EngineFailure | AdminCall] = TypeAdapter(ToSupervisor)


class BadMessage(ValueError):
    """A message that does not fit the control protocol; the connection cannot continue."""


def to_relay(message: dict[str, Any]) -> Table | AdminReply:
    try:
        return _TO_RELAY.validate_python(message)
    except ValidationError as exc:
        raise BadMessage(f"not a supervisor message: {exc.errors()[0]['msg']}") from None


def to_supervisor(message: dict[str, Any]) -> RelayHello | TableApplied | EngineFailure | AdminCall:
    try:
        return _TO_SUPERVISOR.validate_python(message)
    except ValidationError as exc:
        raise BadMessage(f"not a relay message: {exc.errors()[0]['msg']}") from None
