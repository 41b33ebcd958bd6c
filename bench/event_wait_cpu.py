"""CPU the host burns while it waits ~20 ms for the device, by the kind of wait: an event made with
``blocking=True`` (what the engine's step loop waits on, engine/native/sampler.py), a spinning event, a stream's
synchronize. Thread CPU time against wall time, mean of 15 waits after 5 warm-ups (CUDA only).

    python3 bench/event_wait_cpu.py
"""

from __future__ import annotations

import time

import torch

WAIT_S = 0.020


def wait_once(kind: str, cycles: int) -> tuple[float, float]:
    torch.cuda._sleep(cycles)  # the device busy for ~WAIT_S
    event = None
    if kind.startswith("event"):
        event = torch.cuda.Event(blocking=kind == "event-blocking")
        event.record()
    wall, cpu = time.perf_counter(), time.thread_time()
    if event is not None:
        event.synchronize()
    else:
        torch.cuda.current_stream().synchronize()
    return time.perf_counter() - wall, time.thread_time() - cpu


def main() -> None:
    torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    cycles = int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * WAIT_S)  # clock_rate is in kHz
    for kind in ("event-blocking", "event-spin", "stream-sync"):
        waits = [wait_once(kind, cycles) for _ in range(20)][5:]
        wall = 1e3 * sum(w for w, _ in waits) / len(waits)
        cpu = 1e3 * sum(c for _, c in waits) / len(waits)
        print(f"{kind}: wall {wall:.2f} ms, thread CPU {cpu:.2f} ms")


if __name__ == "__main__":
    main()
