"""A parent that has already imported torch and the engine, and forks engine workers on request.

A spawned worker pays Python and torch start-up on every restart (3.5-4.8 s of a 5-6 s restart on
the H200); a forked one starts with those modules in memory. Forking is safe here because this
process never initializes CUDA (it imports torch, touches no device, and checks that before each
fork), starts no threads (one select loop; SIGCHLD arrives through a wakeup pipe), and holds no
GPU handles or open model files: the child creates its own CUDA context, sockets and threads.

Protocol (engine/fork_protocol.py; common/framing.py's length-prefixed JSON, no pickle): one
Unix-socket connection per worker. The supervisor sends a SpawnRequest; the server forks, answers
SpawnReply with the pid, and when it reaps that worker sends ChildExit (its code; negative: killed by
that signal) on the same connection and closes it. A supervisor that closes the connection first only
gives up the exit notice; the worker lives on.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cache.protocol import error_reply
from common.events import configure_logging, log_event, log_warning
from common.framing import ProtocolError, recv_message, send_message
from common.processes import exit_after
from common.proctitle import set_title
from common.uds import bind_unix_socket
from engine.fork_protocol import ChildExit, SpawnReply, SpawnRequest

log = logging.getLogger("warmgate.engine.fork_server")
REQUEST_TIMEOUT = 5.0  # seconds a client has to send its spawn request once connected

ChildMain = Callable[[Sequence[str]], int]  # the worker's command line -> its exit code


def preload(backend: str = "native") -> float:
    """Import what every worker imports (torch, the engine, its HTTP server, the grammar library; vLLM's engine for
    the vllm backend, which takes ~10 s and starts no thread); seconds it took."""
    t = time.perf_counter()
    import fastapi  # noqa: F401
    import torch
    import uvicorn  # noqa: F401

    import engine.grammar
    import engine.native.llm_engine
    import engine.server
    import engine.tokenizer
    import engine.worker

    if backend == "vllm":
        import engine.vllm.engine
        import engine.vllm.loader

        engine.vllm.engine.import_vllm()
    try:
        engine.grammar.load_xgrammar()  # structured outputs; it imports transformers: ~4 s on two cores
    except ImportError as exc:  # a broken install: its engines lose structured outputs, not every start to spawn
        log_warning(log, "preload_failed", module="xgrammar", error=exc)
    if backend == "native":  # not DeepGEMM: it imports torch's cpp_extension, which asks CUDA for its devices
        from engine.native.kernels import preload_triton

        preload_triton()
    with contextlib.suppress(ImportError):  # FastAPI imports it while it builds an app's routes (~0.05 s)
        import pydantic.v1  # noqa: F401
    assert not torch.cuda.is_initialized(), "the fork server must not touch CUDA"
    assert threading.active_count() == 1, f"the fork server must not run threads: {threading.enumerate()}"
    assert forks_can_use_cuda(), "the fork server's imports asked CUDA something: its forks could not use CUDA"
    return time.perf_counter() - t


def forks_can_use_cuda() -> bool:
    """A child forked now could initialize CUDA. torch marks every later fork bad (its CUDA calls then raise "Cannot
    re-initialize CUDA in forked subprocess") once this process has asked CUDA anything, not only once it has
    initialized it: ``torch.cuda.is_available()`` or ``device_count()`` through CUDA's runtime is enough. Importing
    DeepGEMM does that (torch's cpp_extension calls ``is_available()`` when it finds a CUDA toolkit): every engine
    forked after it failed to start on the H100. One fork to find out, a few ms, once."""
    import torch

    pid = os.fork()
    if pid == 0:
        os._exit(1 if torch.cuda._is_in_bad_fork() else 0)  # False where torch has no CUDA
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def serve(socket_path: Path, child_main: ChildMain, backend: str = "native") -> int:
    """Serve spawn requests on ``socket_path`` until SIGTERM/SIGINT; each child runs ``child_main(argv)``."""
    configure_logging()
    set_title(f"fork server {socket_path.parent}")
    log_event(log, "startup", phase="begin", socket=socket_path, pid=os.getpid())
    log_event(log, "startup", phase="import", backend=backend, seconds=preload(backend))
    server = _ForkServer(socket_path, child_main)
    log_event(log, "ready", socket=socket_path)
    try:
        server.run()
    finally:
        server.close()
    log_event(log, "exit", children_running=len(server.children))
    return 0


def _load_tokenizer(argv: list[str]) -> None:
    """Load the tokenizer of the engine about to be forked, here, once (ChatTokenizer.load): the worker inherits
    it instead of loading it in its start-up. Anything wrong is the worker's to report."""
    from engine.config import EngineConfig
    from engine.tokenizer import ChatTokenizer

    if argv[:1] != ["engine"] or "--config" not in argv[:-1]:
        return
    try:
        ChatTokenizer.load(EngineConfig.load(argv[argv.index("--config") + 1]).model)
    except Exception as exc:  # the worker loads it again and fails with its own message
        log_event(log, "tokenizer_preload_failed", error=f"{type(exc).__name__}: {exc}")


class _ForkServer:
    def __init__(self, socket_path: Path, child_main: ChildMain) -> None:
        self.socket_path = socket_path
        self.child_main = child_main
        self.listener = bind_unix_socket(socket_path)
        self.listener.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.selector.register(self.wake_r, selectors.EVENT_READ, "signal")
        self.children: dict[int, socket.socket | None] = {}  # pid -> the connection awaiting its exit
        self.stopping = False
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # delivered through the wakeup pipe
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)

    def _stop(self, signum: int, _frame: Any) -> None:
        self.stopping = True

    def run(self) -> None:
        # It outlives a supervisor that dies (the next one adopts it, app/supervisor/forks.py); SIGTERM stops it.
        while not self.stopping:
            for key, _ in self.selector.select():
                if key.data == "accept":
                    self._accept()
                elif key.data == "signal":
                    while True:
                        try:
                            if not os.read(self.wake_r, 512):
                                break
                        except BlockingIOError:
                            break
                    self._reap()
                else:  # the supervisor closed a connection: it no longer wants that exit notice
                    self._forget(key.fileobj)  # type: ignore[arg-type]

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return
        conn.setblocking(True)
        conn.settimeout(REQUEST_TIMEOUT)
        try:
            message = recv_message(conn)
            if message is None:
                conn.close()
                return
            try:
                request = SpawnRequest.model_validate(message[0])
            except ValueError:
                expected = 'expected {"op": "spawn", "argv": [...], "log": path}'
                send_message(conn, error_reply("invalid_request", expected))
                conn.close()
                return
            argv = request.argv
            pid = self._fork(argv, Path(request.log), conn)
            send_message(conn, SpawnReply(pid=pid).model_dump())
        except (OSError, ProtocolError) as exc:
            log.warning("event=spawn_request_failed error=%s", exc)
            conn.close()
            return
        conn.settimeout(None)
        self.children[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, pid)
        log_event(log, "forked", pid=pid, argv=" ".join(argv))

    def _fork(self, argv: list[str], log_path: Path, conn: socket.socket) -> int:
        import torch

        if torch.cuda.is_initialized():  # never fork a process holding a CUDA context
            raise OSError("the fork server has initialized CUDA; refusing to fork")
        _load_tokenizer(argv)
        # What the server holds (its modules, the tokenizer) out of the collector's generations: the worker's
        # collections during start-up then walk only what it makes (a full one over the server's ~230k objects
        # took 0.12 s on two cores), and reading them never touches the pages the fork shares.
        gc.freeze()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            return pid

        def child() -> int:
            conn.close()
            self._become_child(log_path)
            return self.child_main(argv)

        exit_after(child)

    def _become_child(self, log_path: Path) -> None:
        """Drop everything of the server's, take the log as stdout/stderr, reseed the random generators."""
        os.setsid()  # its own session: signals for the fork server's process group do not reach it
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        self.selector.close()
        self.listener.close()
        for conn in self.children.values():
            if conn is not None:
                conn.close()
        os.close(self.wake_r)
        os.close(self.wake_w)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        import torch

        random.seed()
        torch.seed()  # forked workers would otherwise share the server's generator state

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = os.waitstatus_to_exitcode(status)
            conn = self.children.pop(pid, None)
            log_event(log, "child_exit", pid=pid, code=code)
            if conn is not None:
                self.selector.unregister(conn)
                with contextlib.suppress(OSError):  # the supervisor may be gone
                    send_message(conn, ChildExit(exit=code).model_dump())
                conn.close()

    def _forget(self, conn: socket.socket) -> None:
        self.selector.unregister(conn)
        conn.close()
        for pid, c in self.children.items():
            if c is conn:
                self.children[pid] = None

    def close(self) -> None:
        self.selector.close()
        self.listener.close()
        self.socket_path.unlink(missing_ok=True)
        for conn in self.children.values():
            if conn is not None:
                conn.close()
