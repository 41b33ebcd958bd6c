"""The gateway's listening socket, handed from a process that holds it to one that needs it (SCM_RIGHTS).

The socket must outlive every process of the gateway but the relays that accept on it: a `warmgate serve`
killed with SIGKILL and started again takes the very socket its relays still accept on (so no client is
refused meanwhile), as Envoy's hot restart passes its listeners over a Unix socket. Each relay offers its
copy on ``RUN_DIR/handoff-SLOT.sock`` (0600 in the 0700 run dir: only its owner can take it): whoever connects
gets the descriptor and the connection closes.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from pathlib import Path

from common.uds import bind_unix_socket

PATTERN = "handoff-*.sock"


def offer(path: Path, listener: socket.socket) -> socket.socket:
    """Hand ``listener`` to whoever connects to ``path``, from a daemon thread; returns the offering socket
    (close it, and remove ``path``, to stop offering)."""
    server = bind_unix_socket(path)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed: the process stops offering
                return
            with conn, contextlib.suppress(OSError):
                socket.send_fds(conn, [b"L"], [listener.fileno()])

    threading.Thread(target=serve, name="warmgate-handoff", daemon=True).start()
    return server


def take(run_dir: Path, timeout: float = 2.0) -> socket.socket | None:
    """A listening socket offered in ``run_dir`` by a live process of an earlier gateway, or None."""
    for path in sorted(run_dir.glob(PATTERN)):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(timeout)
        try:
            conn.connect(str(path))
            _, fds, _, _ = socket.recv_fds(conn, 1, 1)
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)  # nobody offers there any more
            continue
        except OSError:  # a relay that does not answer (stopped, busy): try the next
            continue
        finally:
            conn.close()
        if not fds:
            continue
        listener = socket.socket(fileno=fds[0])
        if listener.type == socket.SOCK_STREAM and listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return listener
        listener.close()
    return None


def identity(sock: socket.socket) -> int:
    """The socket's inode: the same for every descriptor of one socket, in any process."""
    return os.fstat(sock.fileno()).st_ino
