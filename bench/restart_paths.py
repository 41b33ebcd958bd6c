"""Restart paths of `warmgate serve` under streaming load: standby promotion, kill -9, fork server, spawn, reload.

    python3 bench/restart_paths.py --model /tmp/wg/llama3-8b-fp8-block --device cuda --clients 32 --out $OUT  # H200
    .venv/bin/python bench/restart_paths.py --device cpu --clients 4 --out bench/results                     # demo

C clients stream completions back to back the whole time (distinct ~160-token prompts, 64 tokens).
*to first token*: from the restart request (or the kill -9) to the first token of a request served
by the new engine: a watcher polls /admin/status every 5 ms and, the moment the active engine is
the new one, sends a streamed 1-token completion; the time of its first token counts. Standby
and fork restarts wait for the standbys between rounds (a fork round's start then has the device to itself and
the active engine under load, as a config change in the steady state). Failed requests are counted per round. Writes
restart_paths.json and restart_paths.md.

Back to back (issue 24): ``--kill-storm N`` kills the active engine N times ``--kill-storm-interval`` s apart,
without waiting for a standby (each kill to the replacement's first token); ``--restart-storm N`` asks for N
admin restarts ``--restart-storm-interval`` s apart (each report's path: a standby, or the fork path).
``--standby`` and ``--kv-cache-bytes 0`` leave the gateway's defaults (standbys by device, KV cache planned from
the device's memory).

    python3 bench/restart_paths.py --model /tmp/wg/llama3-8b-fp8-block --device cuda --clients 32 --standby -1 \
        --kv-cache-bytes 0 --restarts 10 --kills 0 --forks 3 --kill-storm 5 --restart-storm 10 --out $OUT  # H200
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class Load:
    """Clients streaming completions; every token's arrival time is kept (wall clock)."""

    def __init__(self, url: str, clients: int, vocab: int, output: int) -> None:
        self.url, self.vocab, self.output = url, vocab, output
        self.requests: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=300)

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=self.url, timeout=300) as http:
            while not self.stop.is_set():
                prompt = [rng.randrange(1000, self.vocab - 1000) for _ in range(rng.randint(157, 163))]
                body = {"prompt": prompt, "max_tokens": self.output, "temperature": 0, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
                record: dict[str, Any] = {"start": time.time(), "tokens": [], "usage": None}
                try:
                    with http.stream("POST", "/v1/completions", json=body) as response:
                        if response.status_code != 200:
                            raise RuntimeError(f"HTTP {response.status_code}")
                        for line in response.iter_lines():
                            if line.startswith("data: {"):
                                event = json.loads(line[6:])
                                if "error" in event:
                                    raise RuntimeError(event["error"].get("message"))
                                if event.get("choices") and event["choices"][0].get("text"):
                                    record["tokens"].append(time.time())
                                record["usage"] = event.get("usage") or record["usage"]
                    # Every token is there (a resumed stream included): the usage counts the whole request.
                    generated = (record["usage"] or {}).get("completion_tokens")
                    if generated != self.output:
                        raise RuntimeError(f"{generated} tokens instead of {self.output}")
                    record["end"] = time.time()
                except (httpx.HTTPError, RuntimeError) as exc:
                    with self.lock:
                        self.failures.append(f"{type(exc).__name__}: {exc}")
                    continue
                with self.lock:
                    self.requests.append(record)


class LogKeeper:
    """Copies the engines' logs out of the run dir while the run lasts (the gateway keeps only the newest 20)."""

    def __init__(self, run_dir: Path, into: Path) -> None:
        self.run_dir, self.into, self.stop = run_dir, into, threading.Event()
        self.thread = threading.Thread(target=self._keep, daemon=True)
        into.mkdir(parents=True, exist_ok=True)

    def _keep(self) -> None:
        sizes: dict[str, int] = {}
        while not self.stop.wait(0.25):
            for log in self.run_dir.glob("engine-*.log"):
                try:
                    size = log.stat().st_size
                    if sizes.get(log.name) != size:
                        (self.into / log.name).write_bytes(log.read_bytes())
                        sizes[log.name] = size
                except OSError:
                    continue

    def steps_after_activation(self, engine: int | None) -> list[dict[str, float]]:
        """The engine's step_after_activation lines (engine/native/llm_engine.py): its first steps once promoted."""
        rows = []
        for log in self.into.glob(f"engine-*-{engine}.log"):
            for line in log.read_text(errors="replace").splitlines():
                if "event=step_after_activation" in line:
                    fields = dict(f.split("=", 1) for f in line.split("event=", 1)[1].split()[1:] if "=" in f)
                    rows.append({k: float(v) for k, v in fields.items()})
        return rows


def first_token_from_new_engine(url: str, admin: httpx.Client, old: int | None) -> float:
    """Once the active engine is not ``old``, a 1-token streamed completion: its first token's wall time."""
    wait(lambda: admin.get("/admin/status").json()["active"] not in (None, old), 600, "no new active engine",
         interval=0.005)  # fmt: skip
    body = {"prompt": [1000, 1001, 1002, 1003], "max_tokens": 1, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                return time.time()
    raise SystemExit("the probe got no token")


def wait(condition, seconds: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise SystemExit(f"timed out: {what}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--restarts", type=int, default=10)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--forks", type=int, default=3)
    parser.add_argument("--kv-cache-bytes", type=int, default=8 * 10**9, help="0: planned from the device")
    parser.add_argument("--standby", type=int, default=1, help="-1: the gateway's default")
    parser.add_argument("--kill-storm", type=int, default=0)
    parser.add_argument("--kill-storm-interval", type=float, default=1.5)
    parser.add_argument("--restart-storm", type=int, default=0)
    parser.add_argument("--restart-storm-interval", type=float, default=1.0)
    args = parser.parse_args()
    standbys = args.standby if args.standby >= 0 else 2 if args.device.startswith("cuda") else 1  # the default
    if args.model is None:
        from cache.checkpoint.demo import build_demo

        args.model = build_demo("fp8-block", progress=False)
    root = Path(tempfile.mkdtemp(prefix="warmgate-restarts-"))
    config = root / "warmgate.toml"
    kv = "max_model_len = 512\n" if args.device == "cpu" else \
        f"kv_cache_bytes = {args.kv_cache_bytes}\n" if args.kv_cache_bytes else ""  # fmt: skip
    standby = f"standby = {args.standby}\n" if args.standby >= 0 else ""
    config.write_text(f'model = "{args.model}"\n\n[engine]\ndevice = "{args.device}"\nmax_num_seqs = 64\n{kv}\n'
                      f"[restart]\n{standby}health_interval = 1.0\nhealth_timeout = 20.0\n")  # fmt: skip
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = root / "serve.log"
    t0 = time.perf_counter()
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--config", str(config), "--port",
                                 str(port), "--run-dir", str(root / "run")], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "date": time.strftime("%F %T")}
    load = Load(url, args.clients, args.vocab, args.output_len)
    logs = LogKeeper(root / "run", root / "logs")
    logs.thread.start()
    try:
        wait(lambda: proc.poll() is None and _ready(url), 900, "the gateway did not become ready")
        result["cold_start_s"] = time.perf_counter() - t0
        token = (root / "run" / "admin-token").read_text().strip()
        admin = httpx.Client(base_url=url, headers={"authorization": f"Bearer {token}"}, timeout=600)

        def status() -> dict[str, Any]:
            return admin.get("/admin/status").json()  # type: ignore[no-any-return]

        result["cold_start_report"] = status()["restarts"][0]
        wait(lambda: status()["standbys"], 600, "no standby")
        result["standby_memory"] = _memory(status(), args.device)
        load.start()
        wait(lambda: len(load.requests) >= args.clients, 600, "the load did not start")
        rounds: dict[str, list[dict[str, Any]]] = {"standby": [], "kill": [], "kill storm": [], "restart storm": [],
                                                   "fork": [], "spawn": [], "reload": []}  # fmt: skip

        def restart(kind: str, body: dict[str, Any]) -> None:
            old, failed = status()["active"], len(load.failures)
            done: dict[str, Any] = {}
            poster = threading.Thread(target=lambda: done.update(admin.post("/admin/restart", json=body).json()))
            t = time.time()
            poster.start()
            first = first_token_from_new_engine(url, admin, old)
            poster.join()
            rounds[kind].append({"to_first_token_s": first - t, "report": done,
                                 "failed_during": len(load.failures) - failed})  # fmt: skip
            print(kind, round(first - t, 3), done.get("path"), done.get("phases"), flush=True)

        def kill_active() -> tuple[float, float, int]:
            """kill -9 of the active engine: when, its replacement's first token, the failures before."""
            now = status()
            old, failed = now["active"], len(load.failures)
            pid = next(e["pid"] for e in now["engines"] if e["id"] == old)
            killed = time.time()
            os.kill(pid, signal.SIGKILL)
            return killed, first_token_from_new_engine(url, admin, old), failed

        for _ in range(args.restarts):
            wait(lambda: status()["standbys"], 600, "no standby")
            restart("standby", {})
        kills_began = time.time()
        for _ in range(args.kills):
            time.sleep(3)  # streams in flight on the engine about to die
            wait(lambda: status()["standbys"], 600, "no standby")
            before = len([r for r in status()["restarts"] if r["reason"] == "crash"])
            t, first, failed = kill_active()
            crash = wait(lambda: [r for r in status()["restarts"] if r["reason"] == "crash"][before:], 120, "recovery")
            rounds["kill"].append({"to_first_token_s": first - t, "report": crash[0], "killed_at": t,
                                   "failed_during": len(load.failures) - failed})  # fmt: skip
            print("kill", round(first - t, 3), crash[0]["path"], flush=True)
        kills_ended = time.time()
        if args.kill_storm:
            wait(lambda: len(status()["standbys"]) >= standbys, 600, "no standbys before the storm")
        for _ in range(args.kill_storm):  # back to back: no wait for a standby
            t, first, failed = kill_active()
            rounds["kill storm"].append({"to_first_token_s": first - t, "killed_at": t,
                                         "failed_during": len(load.failures) - failed})  # fmt: skip
            print("kill storm", round(first - t, 3), flush=True)
            time.sleep(max(0.0, t + args.kill_storm_interval - time.time()))
        if args.kill_storm:
            kills_ended = time.time()
            crashes = [r for r in status()["restarts"] if r["reason"] == "crash"][-args.kill_storm :]
            for row, report in zip(rounds["kill storm"], crashes, strict=False):
                row["report"] = report
        time.sleep(15)  # requests after the kills
        if args.restart_storm:
            wait(lambda: len(status()["standbys"]) >= standbys, 600, "no standbys before the storm")
            failed, threads, answers = len(load.failures), [], []

            def ask(asked: float) -> None:
                report = admin.post("/admin/restart", json={}).json()
                answers.append((asked, time.time(), report))

            began = time.time()
            for i in range(args.restart_storm):
                time.sleep(max(0.0, began + i * args.restart_storm_interval - time.time()))
                thread = threading.Thread(target=ask, args=(time.time(),))
                thread.start()
                threads.append(thread)
            for thread in threads:
                thread.join()
            for asked, answered, report in sorted(answers, key=lambda x: x[0]):
                rounds["restart storm"].append({"to_first_token_s": answered - asked, "report": report,
                                                "failed_during": 0})  # fmt: skip
            if rounds["restart storm"]:
                rounds["restart storm"][-1]["failed_during"] = len(load.failures) - failed
            print("restart storm paths", [r["report"].get("path") for r in rounds["restart storm"]], flush=True)
        killed = [r["killed_at"] for r in rounds["kill"] + rounds["kill storm"]]
        result["around_kills"] = _around(load.requests, kills_began, killed, kills_ended)
        for row in rounds["kill"] + rounds["kill storm"]:  # the streams it cut: their first token after it
            switched = (row.get("report") or {}).get("switched_at")
            row["resumed_first_token_s"] = _resumed(load.requests, row["killed_at"], switched) if switched else None
        for i in range(args.forks):  # another config each time: no standby matches, the fork server starts one
            # In the steady state a config change meets (the standbys built, nothing starting beside it); back to back,
            # each round's start shared the device with the builds of the one before (stopped when it begins).
            wait(lambda: len(status()["standbys"]) >= standbys, 600, "no standbys before a fork round")
            restart("fork", {"engine": {"default_max_tokens": 200 + i}})
        forks = _pid_of(f"fork-server --socket {root / 'run'}")
        if forks:
            os.kill(forks, signal.SIGKILL)
            restart("spawn", {"engine": {"default_max_tokens": 300}})
        config.write_text(config.read_text().replace("max_num_seqs = 64", "max_num_seqs = 48"))
        failed = len(load.failures)
        t = time.time()
        reload = admin.post("/admin/reload").json()
        time.sleep(2)
        rounds["reload"].append({"seconds": time.time() - t, "report": reload,
                                 "failed_during": len(load.failures) - failed})  # fmt: skip
    finally:
        load.finish()
        logs.stop.set()
        logs.thread.join()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    for row in rounds["kill"] + rounds["kill storm"]:
        row["steps_after_activation"] = logs.steps_after_activation((row.get("report") or {}).get("engine"))
    result["rounds"] = rounds
    result["requests"], result["failures"] = len(load.requests), load.failures
    summary = {k: _stats([r["to_first_token_s"] for r in v]) for k, v in rounds.items() if k != "reload"}
    result["summary"] = summary
    result["failures_by_kind"] = sorted(set(load.failures))[:20]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "restart_paths.json").write_text(json.dumps(result, indent=1))
    lines = [f"restart paths, {args.device}, {args.clients} streaming clients, {result['requests']} requests, "
             f"{len(load.failures)} failed; cold start {result['cold_start_s']:.1f} s", "",
             "| path | n | to first token p50 | min | max |", "|---|---|---|---|---|"]  # fmt: skip
    lines[-2:] = ["| path | n | to first token p50 | min | max | failed requests |", "|---|---|---|---|---|---|"]
    for kind, s in summary.items():
        if s["n"]:
            failed = sum(r["failed_during"] for r in rounds[kind])
            lines.append(f"| {kind} | {s['n']} | {s['p50_s']:.3f} s | {s['min_s']:.3f} s | {s['max_s']:.3f} s "
                         f"| {failed} |")  # fmt: skip
    if "around_kills" in result:
        lines += ["", "requests around the kills (TTFT and TPOT in ms, p50 / p90):", "",
                  "| window | requests | TTFT p50 | TTFT p90 | TPOT p50 | TPOT p90 |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for window, st in result["around_kills"].items():
            lines.append(f"| {window} | {st['n']} | {st['ttft_p50_ms']} | {st['ttft_p90_ms']} | "
                         f"{st['tpot_p50_ms']} | {st['tpot_p90_ms']} |")  # fmt: skip
    reload_failed = sum(r["failed_during"] for r in rounds["reload"])
    reload_path = rounds["reload"][0]["report"].get("path") if rounds["reload"] else "-"
    lines.append(f"\nreload (max_num_seqs 64 -> 48): path {reload_path}, failed requests {reload_failed}")
    if rounds["restart storm"]:
        paths = [r["report"].get("path") for r in rounds["restart storm"]]
        lines.append(f"\nrestart storm ({args.restart_storm} restarts {args.restart_storm_interval} s apart; its row's "
                     f"figures are request to answer): paths {paths}")  # fmt: skip
    if rounds["kill storm"]:
        paths = [r.get("report", {}).get("path") for r in rounds["kill storm"]]
        lines.append(f"\nkill storm ({args.kill_storm} kills {args.kill_storm_interval} s apart): paths {paths}")
    resumed = [r.get("resumed_first_token_s") for r in rounds["kill"] + rounds["kill storm"]]
    if resumed:
        shown = ", ".join("-" if v is None else f"{v:.3f}" for v in resumed)
        lines.append(f"\nkill to the first token of a stream in flight at it, per kill (s): {shown}")
    for i, row in enumerate(rounds["kill"] + rounds["kill storm"]):
        steps = "; ".join(f"{s['launched_ms']:.0f}-{s['read_ms']:.0f} ms: {s['tokens']:.0f} tokens "
                          f"({s['prompt_tokens']:.0f} prompt, {s['seqs']:.0f} seqs), device {s['device_ms']:.1f} ms"
                          for s in row["steps_after_activation"])  # fmt: skip
        phases = {k: round(v, 3) for k, v in (row.get("report") or {}).get("phases", {}).items()}
        lines.append(f"\nkill {i + 1}: {phases}; steps after the activation was asked for: {steps or '-'}")
    lines.append(f"\nstandby memory: {result['standby_memory']}")
    (args.out / "restart_paths.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=30).status_code == 200
    except httpx.TransportError:
        return False


def _stats(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50_s": statistics.median(values), "min_s": min(values), "max_s": max(values),
            "values_s": values}  # fmt: skip


def _resumed(requests: list[dict[str, Any]], killed: float, switched: float) -> float | None:
    """From the kill to the first token that a stream in flight at it received from the engine that took over
    (after the switch: tokens of the killed engine still on their way arrive after the kill too): what those
    clients waited, beside the probe's (a new request, queued behind their re-prefill)."""
    after = [next(t for t in r["tokens"] if t > switched) for r in requests
             if r["start"] < killed < r.get("end", 0) and r["tokens"] and r["tokens"][-1] > switched]  # fmt: skip
    return min(after) - killed if after else None


def _around(requests: list[dict[str, Any]], began: float, kills: list[float], ended: float) -> dict[str, Any]:
    """TTFT and TPOT of the requests that ended in the 30 s before the kills, spanned a kill, or began after."""
    windows: dict[str, list[dict[str, Any]]] = {"before": [], "during (in flight at a kill)": [], "after": []}
    for r in requests:
        if not r["tokens"] or "end" not in r:
            continue
        if began - 30 < r["end"] < began:
            windows["before"].append(r)
        elif any(r["start"] < k < r["end"] for k in kills):
            windows["during (in flight at a kill)"].append(r)
        elif ended < r["start"] < ended + 15:
            windows["after"].append(r)

    def q(values: list[float], p: float) -> float:
        return round(1000 * sorted(values)[min(len(values) - 1, int(p * len(values)))], 1) if values else float("nan")

    out = {}
    for name, rs in windows.items():
        ttft = [r["tokens"][0] - r["start"] for r in rs]
        tpot = [(r["tokens"][-1] - r["tokens"][0]) / (len(r["tokens"]) - 1) for r in rs if len(r["tokens"]) > 1]
        out[name] = {"n": len(rs), "ttft_p50_ms": q(ttft, 0.5), "ttft_p90_ms": q(ttft, 0.9),
                     "tpot_p50_ms": q(tpot, 0.5), "tpot_p90_ms": q(tpot, 0.9)}  # fmt: skip
    return out


def _pid_of(cmdline_part: str) -> int | None:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if cmdline_part in cmdline:
                return int(entry.name)
    return None


def _memory(status: dict[str, Any], device: str) -> dict[str, Any]:
    """Each engine's memory: device memory per process on CUDA (nvidia-smi), private RSS on CPU."""
    engines = {e["pid"]: e["state"] for e in status["engines"]}
    if device.startswith("cuda"):
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True).stdout  # fmt: skip
        used = {int(p): int(m) for p, m in (line.split(", ") for line in out.strip().splitlines() if line)}
        return {f"{engines.get(pid, 'cache or other')} (pid {pid})": f"{mib} MiB" for pid, mib in used.items()}
    result = {}
    for pid, state in engines.items():
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                result[f"{state} (pid {pid})"] = line.split(":")[1].strip()
    return result


if __name__ == "__main__":
    main()
