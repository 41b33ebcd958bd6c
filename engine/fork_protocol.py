"""The fork server's messages (engine/fork_server.py), framed by common/framing.py: one connection per worker.

supervisor -> fork server   SpawnRequest
fork server -> supervisor   SpawnReply (or the error reply of cache/protocol.py), then ChildExit when the
                            worker is reaped
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SpawnRequest(_Message):
    op: Literal["spawn"] = "spawn"
    argv: list[str] = Field(min_length=1)  # the worker's `warmgate ...` command line
    log: str  # the worker's stdout and stderr go to this file


class SpawnReply(_Message):
    ok: Literal[True] = True
    pid: int


class ChildExit(_Message):
    exit: int  # the worker's exit code (negative: killed by that signal)
