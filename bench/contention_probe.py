"""What a second CUDA process pays while another keeps the GPU busy (the fork path under load) or is being torn down
after a kill -9 (a standby's promotion at a crash), measured in fresh processes on the device machine:

* start-up costs in a fresh process, idle GPU vs one busy with back-to-back graph replays of 8192x4096x4096 bf16
  GEMMs (an active engine's stand-in): context creation, a round trip (tiny kernel + synchronize), the first call
  of 24 distinct torch ops (lazy kernel loading), a 1 GiB cudaMalloc, a 2 GiB VMM allocation mapped;
* a kill: a busy process holding ``--victim-gb`` GB is killed; once a socket it held reads EOF (the supervisor's
  lifeline), a ready process maps 2 GiB (cuMemCreate + cuMemMap + cuMemSetAccess, as a promotion's commit) and runs
  a fixed GEMM workload; the same without a kill for comparison.

    PYTHONPATH=/tmp/site:$PWD python3 bench/contention_probe.py --out $OUT    # on the device machine (H200)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPS = ["sin", "cos", "exp", "log1p", "tanh", "sigmoid", "erf", "sqrt", "rsqrt", "abs", "neg", "floor", "ceil", "round",
       "expm1", "log2", "exp2", "atan", "asin", "sinh", "cosh", "reciprocal", "trunc", "frac"]  # fmt: skip


def busy(gb: int, sock_fd: int) -> None:
    """An active engine's stand-in: ``gb`` GB held, graph replays of GEMMs back to back until killed."""
    import torch

    held = torch.empty(gb << 30, dtype=torch.uint8, device="cuda") if gb else None
    a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        a @ b
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(4):
            c = a @ b
    del c, held
    os.write(sock_fd, b"ready")
    while True:  # ~2-3 ms per replay; the host keeps a few queued, as an engine's step loop does
        graph.replay()
        torch.cuda.current_stream().synchronize() if os.environ.get("BUSY_SYNC") else None


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _map(size: int) -> float:
    """cuMemCreate + cuMemMap + cuMemSetAccess of ``size`` bytes (a promotion's first stripe), seconds."""
    import torch

    from common import cuda_vmm

    cu, dev = cuda_vmm.driver(), torch.device("cuda", 0)
    t = time.perf_counter()
    prop = cuda_vmm.allocation_prop(cu, dev, exportable=False)
    ptr = int(cuda_vmm.check(cu.cuMemAddressReserve(size, 0, 0, 0)))
    handle = cuda_vmm.check(cu.cuMemCreate(size, prop, 0))
    cuda_vmm.check(cu.cuMemMap(ptr, size, 0, handle, 0))
    cuda_vmm.set_access(cu, ptr, size, dev, writable=True)
    return time.perf_counter() - t


def fresh() -> dict[str, object]:
    """A fresh process's first uses of the device."""
    import torch

    out: dict[str, object] = {"context_s": _timed(lambda: torch.zeros(1, device="cuda"))}
    x = torch.ones(1, device="cuda")
    trips = []
    for _ in range(20):
        trips.append(_timed(lambda: (x.add_(1), torch.cuda.synchronize())))
    out["round_trip_ms_p50"] = 1e3 * sorted(trips)[10]
    out["round_trip_ms_max"] = 1e3 * max(trips)
    y = torch.rand(4096, device="cuda")
    firsts = [_timed(lambda op=op: (getattr(torch, op)(y), torch.cuda.synchronize())) for op in OPS]
    seconds = [_timed(lambda op=op: (getattr(torch, op)(y), torch.cuda.synchronize())) for op in OPS]
    out["first_op_calls_s"] = sum(firsts)
    out["second_op_calls_s"] = sum(seconds)
    out["first_op_call_ms_p50"] = 1e3 * sorted(firsts)[len(firsts) // 2]
    rare = ["sinc", "digamma", "lgamma", "i0", "erfinv", "logit"]
    out["launch_only_first_calls_s"] = _timed(lambda: [getattr(torch, op)(y) for op in rare])  # no wait for the device
    torch.cuda.synchronize()
    out["malloc_1gib_s"] = _timed(lambda: torch.empty(1 << 30, dtype=torch.uint8, device="cuda"))
    out["vmm_map_2gib_s"] = _map(2 << 30)
    return out


def ready_then_measure(sock_fd: int) -> None:
    """A standby's stand-in: initialized and warmed, then on "go" maps 2 GiB and runs a fixed GEMM workload."""
    import torch

    a = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    _map(64 << 20)
    os.write(sock_fd, b"ready")
    os.read(sock_fd, 2)
    out = {"vmm_map_2gib_s": _map(2 << 30)}

    def work() -> None:
        for _ in range(32):
            a @ b
        torch.cuda.synchronize()

    out["gemm_work_s"] = _timed(work)
    out["gemm_work_again_s"] = _timed(work)
    os.write(sock_fd, json.dumps(out).encode())


def _child(role: str, *args: str) -> tuple[subprocess.Popen[bytes], socket.socket]:
    mine, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, __file__, role, str(theirs.fileno()), *args], pass_fds=[theirs.fileno()],
                            cwd=ROOT)  # fmt: skip
    theirs.close()
    return proc, mine


def _fresh_run() -> dict[str, object]:
    out = subprocess.run([sys.executable, __file__, "fresh"], capture_output=True, text=True, cwd=ROOT, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def kill_case(victim_gb: int, kill: bool) -> dict[str, object]:
    victim, vsock = _child("busy", str(victim_gb))
    assert vsock.recv(16) == b"ready"
    standby, ssock = _child("standby")
    assert ssock.recv(16) == b"ready"
    time.sleep(1.0)
    t0 = time.perf_counter()
    if kill:
        os.kill(victim.pid, signal.SIGKILL)
        vsock.recv(16)  # EOF: the victim's files are closing (the lifeline)
    eof = time.perf_counter() - t0
    ssock.send(b"go")
    result = json.loads(ssock.recv(1 << 16).decode())
    result["eof_s"] = eof if kill else None
    for p in (victim, standby):
        p.kill()
        p.wait()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--victim-gb", type=int, default=57)
    args = parser.parse_args()
    results: dict[str, object] = {"idle (disk caches warmed)": (_fresh_run(), _fresh_run())[1]}
    load, lsock = _child("busy", "8")
    assert lsock.recv(16) == b"ready"
    results["under load"] = [_fresh_run() for _ in range(2)]
    load.kill()
    load.wait()
    results["no kill (standby beside a busy engine)"] = kill_case(args.victim_gb, kill=False)
    results["kill -9 of a busy engine"] = [kill_case(args.victim_gb, kill=True) for _ in range(2)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "contention_probe.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    if len(sys.argv) > 1 and sys.argv[1] == "busy":
        busy(int(sys.argv[3]), int(sys.argv[2]))
    elif len(sys.argv) > 1 and sys.argv[1] == "standby":
        ready_then_measure(int(sys.argv[2]))
    elif len(sys.argv) > 1 and sys.argv[1] == "fresh":
        print(json.dumps(fresh()))
    else:
        main()
