"""A relay worker process (data plane): serves the OpenAI API on the gateway's listening socket, which every relay
shares (opened once by the supervisor and inherited, as nginx's workers share theirs), on uvloop and httptools.

    warmgate relay --control RUN_DIR/control.sock --listen-fd N --index I --board RUN_DIR/admission.board
                                                                                (started by `warmgate serve`)

It takes its engine table and settings from the supervisor (app/relay/link.py) before it accepts anything,
and serves on with the last table when the supervisor dies (the next one adopts it). It offers its listening
socket to a later `warmgate serve` on RUN_DIR/handoff-INDEX.sock (common/handoff.py). SIGTERM stops
accepting; requests in flight get up to ``drain_timeout`` seconds, and keep-alive connections are closed without
racing their clients (app/relay/server.py).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import time
from pathlib import Path

from common.events import configure_logging, log_event

log = logging.getLogger("warmgate.relay")


def main(control: Path, listen_fd: int, index: int, board: Path, drain_timeout: float) -> int:
    started = time.perf_counter()
    configure_logging()
    from common.proctitle import set_title

    set_title(f"relay {index} {control.parent}")
    import uvloop

    uvloop.run(_serve(control, listen_fd, index, board, drain_timeout, started))
    return 0


async def _serve(control: Path, listen_fd: int, index: int, board: Path, drain_timeout: float,
                 started: float) -> None:  # fmt: skip
    from app.control import Table
    from app.metrics import RelayMetrics
    from app.relay.admission import Admission
    from app.relay.app import RelayApp
    from app.relay.board import AdmissionBoard
    from app.relay.link import SupervisorLink
    from app.relay.relay import Relay
    from app.relay.server import server as relay_server
    from app.relay.table import TableView
    from app.relay.upstream import EnginePool

    table, pool, metrics = TableView(), EnginePool(), RelayMetrics()
    admission = Admission(table, AdmissionBoard(board, index), metrics)

    def on_table(new: Table) -> None:
        table.apply(new)
        admission.kick()
        pool.forget({e.socket for e in (new.active, *new.standbys, *new.draining) if e is not None})

    from common import handoff

    listener = socket.socket(fileno=listen_fd)
    listener.setblocking(False)
    link = SupervisorLink(control, index, on_table, handoff.identity(listener))
    await link.connect()
    offering_path = control.parent / f"handoff-{index}.sock"
    offering = handoff.offer(offering_path, listener)
    relay = Relay(table, admission, pool, metrics, link.report_failure)
    app = RelayApp(table, relay, link)
    server = relay_server(app, drain_timeout, timeout_keep_alive=30)
    loop = asyncio.get_running_loop()

    def stop(reason: str) -> None:
        if not server.should_exit:
            log_event(log, "stopping", relay=index, reason=reason)
        server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop, sig.name)
    following = asyncio.create_task(link.run())  # until the relay stops: a supervisor that dies is waited for
    # What start-up made lives as long as the relay: out of the collector's generations, full collections while
    # serving do not walk it again.
    gc.collect()
    gc.freeze()
    log_event(log, "ready", relay=index, pid=os.getpid(), generation=table.generation,
              seconds=time.perf_counter() - started)  # fmt: skip
    try:
        await server.serve(sockets=[listener])
    finally:
        offering.close()
        offering_path.unlink(missing_ok=True)
        following.cancel()
        link.close()
        pool.close()
        log_event(log, "exit", relay=index, seconds=time.perf_counter() - started)
