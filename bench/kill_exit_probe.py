"""How long a kill -9'd CUDA process takes to be seen dead, by its memory: from the kill to (a) its lifeline
(common/lifeline.py: a robust mutex it holds, released as its threads begin to exit), (b) EOF on a socket the child
holds at a low fd (closed before the CUDA driver's files, which are opened later) and (c) the pidfd saying it
exited. Modes: torch.empty of N GB (one allocation), or VMM: N GB as `pieces` allocations mapped.

    PYTHONPATH=/tmp/site:$PWD python3 bench/kill_exit_probe.py    # on the device machine (H200)
"""

import json
import os
import select
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())

from common import lifeline


def child(sock: socket.socket, mode: str, gb: int, pieces: int, life: Path) -> None:
    lifeline.hold(life)
    import torch

    torch.cuda.init()
    x = None
    if mode == "torch":
        x = torch.empty(gb << 30, dtype=torch.uint8, device="cuda")
        x.zero_()
    else:
        from common import cuda_vmm

        cu = cuda_vmm.driver()
        dev = torch.device("cuda", 0)
        prop = cuda_vmm.allocation_prop(cu, dev, exportable=False)
        size = (gb << 30) // pieces // (2 << 20) * (2 << 20)
        ptr = int(cuda_vmm.check(cu.cuMemAddressReserve(size * pieces, 0, 0, 0)))
        for i in range(pieces):
            h = cuda_vmm.check(cu.cuMemCreate(size, prop, 0))
            cuda_vmm.check(cu.cuMemMap(ptr + i * size, size, 0, h, 0))
            cuda_vmm.set_access(cu, ptr + i * size, size, dev, writable=True)
        torch.cuda.synchronize()
    fds = sorted(int(f) for f in os.listdir("/proc/self/fd"))
    targets = {f: os.readlink(f"/proc/self/fd/{f}") for f in fds if os.path.exists(f"/proc/self/fd/{f}")}
    sock.send(json.dumps({"lifeline_fd": sock.fileno(), "fds": targets}).encode())
    time.sleep(600)


def run(mode: str, gb: int, pieces: int) -> dict:
    life = Path(tempfile.mkdtemp()) / "probe.life"
    lifeline.create(life)
    parent, kid = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        parent.close()
        try:
            child(kid, mode, gb, pieces, life)
        finally:
            os._exit(0)
    kid.close()
    info = json.loads(parent.recv(1 << 20).decode())
    pidfd = os.pidfd_open(pid)
    cut: list[float] = []

    def watch() -> None:
        if lifeline._wait(life, threading.Event()):
            cut.append(time.perf_counter())

    watcher = threading.Thread(target=watch)
    watcher.start()
    time.sleep(0.5)
    t0 = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    eof = exited = None
    poll = select.poll()
    poll.register(parent, select.POLLIN | select.POLLHUP)
    poll.register(pidfd, select.POLLIN)
    while eof is None or exited is None:
        for fd, _ in poll.poll(10000):
            now = time.perf_counter() - t0
            if fd == parent.fileno() and eof is None:
                eof = now
                poll.unregister(parent)
            elif fd == pidfd and exited is None:
                exited = now
                poll.unregister(pidfd)
    os.waitpid(pid, 0)
    watcher.join()
    life.unlink()
    nvidia = [f for f, t in info["fds"].items() if "nvidia" in t]
    return {
        "mode": mode,
        "gb": gb,
        "pieces": pieces,
        "lifeline_fd": info["lifeline_fd"],
        "nvidia_fds": f"{min(nvidia, key=int)}..{max(nvidia, key=int)} ({len(nvidia)})" if nvidia else "",
        "lifeline_s": round(cut[0] - t0, 4) if cut else None,
        "eof_s": round(eof, 4),
        "exit_s": round(exited, 4),
    }


if __name__ == "__main__":
    for mode, gb, pieces in [("torch", 8, 1), ("torch", 57, 1), ("vmm", 57, 64)]:
        print(json.dumps(run(mode, gb, pieces)), flush=True)
