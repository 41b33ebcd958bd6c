"""Unix-domain sockets for local services: private directory, 0600 socket, peer credentials.

Both the cache process and engine workers serve on sockets that only their own user may
reach: the directory is 0700, the socket 0600 from the moment it exists, and the cache
also checks each peer's uid (SO_PEERCRED), so a permissive directory is not enough to get in.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int


def peer_credentials(conn: socket.socket) -> PeerCredentials:
    """The connecting process's pid, uid and gid, as the kernel recorded them at connect()."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCredentials(pid, uid, gid)


def private_dir(path: Path) -> None:
    """Create ``path`` with mode 0700, or check an existing one is ours and closed to others."""
    if not path.exists():
        path.mkdir(mode=0o700, parents=True)
        path.chmod(0o700)  # mkdir's mode is filtered by the umask
        return
    st = path.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{path} is not a directory")
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"socket directory {path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}, "
            f"owner uid {st.st_uid}); use a private directory (mode 0700, owned by uid {os.getuid()})"
        )


def bind_unix_socket(path: Path, *, private: bool = False, into: socket.socket | None = None) -> socket.socket:
    """A listening socket at path, mode 0600; a stale socket file is replaced, a live one is an error.

    ``private``: also create/check the directory as 0700 (``private_dir``). ``into``: bind this (unbound) socket
    instead of a new one (an engine's front processes inherit it before it is bound).
    """
    if private:
        private_dir(path.parent)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise FileExistsError(f"{path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)  # left behind by a process that died
        else:
            raise FileExistsError(f"another process is serving on {path}")
        finally:
            probe.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    sock = into if into is not None else socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Set through the umask, the socket is 0600 from the moment it exists (a chmod after bind leaves a window).
    old_umask = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old_umask)
    sock.listen(256)
    return sock


def socket_is_stale(path: Path) -> bool:
    """A socket file nobody listens on (left behind by a process that was killed)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return True
    except OSError:
        return False
    finally:
        probe.close()
    return False


def remove_if_stale(path: Path) -> bool:
    """Remove ``path`` if it is a socket file nobody listens on; whether it was."""
    if not socket_is_stale(path):
        return False
    path.unlink(missing_ok=True)
    return True
