"""A request's work cancelled when its client goes away: one watcher for the relays' routes and the engine's."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]  # ASGI's receive (starlette.types.Receive)


async def cancelled_on_disconnect(work: Awaitable[None], receive: Receive, answered: Callable[[], bool]) -> None:
    """Await ``work`` in this task; if the client disconnects first (uvicorn's ``receive`` says so, the request's
    body already read), the task is cancelled and this returns quietly. ``answered``: the response has been sent
    (uvicorn also says "disconnect" then)."""
    task = asyncio.current_task()
    assert task is not None
    left = False

    async def watch() -> None:
        nonlocal left
        while (await receive())["type"] != "http.disconnect":
            pass
        if not answered():
            left = True
            task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        await work
    except asyncio.CancelledError:
        if not left:
            raise
        task.uncancel()
    finally:
        watcher.cancel()
