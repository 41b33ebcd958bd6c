"""`warmgate serve` end to end, with the official openai client, on the fp8-block demo (CPU)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import processes
import pytest
from fault.load import send
from processes import REPO, wait_for

MODEL_NAME = "demo"
API_KEY = "sk-warmgate-test"
AUTH = {"authorization": f"Bearer {API_KEY}"}


class Gateway(processes.Gateway):
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, timeout=120, max_retries=0)


def write_config(path: Path, model: Path, max_num_seqs: int = 8, default_max_tokens: int = 256,
                 dtype: str = "auto") -> None:  # fmt: skip
    path.write_text(
        f'model = "{model}"\nserved_model_name = "{MODEL_NAME}"\n\n'
        f"[engine]\nmax_num_seqs = {max_num_seqs}\nmax_model_len = 512\ndefault_max_tokens = {default_max_tokens}\n"
        f'dtype = "{dtype}"\n\n'
        '[restart]\nstrategy = "overlap"\ndrain_timeout = 30\nqueue_timeout = 120\n\n'
        f'[gateway]\napi_keys = ["{API_KEY}"]\n'
    )


@pytest.fixture(scope="module")
def model(demo_path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of the fp8-block demo: one test overwrites its tensor data."""
    copy = tmp_path_factory.mktemp("model") / "demo-fp8-block"
    shutil.copytree(demo_path("fp8-block"), copy)
    return copy


@pytest.fixture(scope="module")
def gateway(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    root = tmp_path_factory.mktemp("gateway")
    write_config(root / "warmgate.toml", model)
    started = processes.start_gateway(root, (root / "warmgate.toml").read_text())
    gw = Gateway(**{f: getattr(started, f) for f in ("proc", "url", "run_dir", "config", "log_path")})
    yield gw
    gw.stop()


@pytest.fixture(autouse=True)
def _config_as_started(gateway: Gateway) -> Iterator[None]:
    """Each test finds the gateway on the config it started with: one that changed it (and reloaded) gets it back,
    file and engines, so no test depends on what an earlier one left."""
    assert gateway.config is not None
    original = gateway.config.read_text()
    yield
    if gateway.proc.poll() is None and gateway.config.read_text() != original:
        gateway.config.write_text(original)
        reload = gateway.admin("POST", "/admin/reload")
        assert reload.status_code == 200 and reload.json()["ok"], reload.text


def test_openai_client_chat_completions_streaming_stops_and_errors(gateway: Gateway) -> None:
    client = gateway.client()
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such/model x")
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert "no-such/model x" in missing.value.body["message"]  # type: ignore[index]
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0
    )
    answer = chat.choices[0].message.content or ""
    assert "Paris" in answer and chat.choices[0].finish_reason == "stop"
    assert chat.usage is not None and chat.usage.completion_tokens > 0
    pieces = []
    for chunk in client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0,
        stream=True,
    ):  # fmt: skip
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    assert "".join(pieces) == answer

    text = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=5,
                                     temperature=0)  # fmt: skip
    assert text.choices[0].finish_reason == "length" and text.usage is not None and text.usage.completion_tokens == 5
    chunks = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=5,
                                       temperature=0, stream=True)  # fmt: skip
    streamed = "".join(c.choices[0].text for c in chunks)
    assert streamed == text.choices[0].text

    before = answer.split(" Paris")[0]
    stopped = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0,
        stop=[" Paris"],
    )  # fmt: skip
    assert stopped.choices[0].message.content == before and stopped.choices[0].finish_reason == "stop"

    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL_NAME, messages=[], max_tokens=-1)
    assert bad.value.status_code == 400 and bad.value.body and "message" in bad.value.body  # type: ignore[operator]
    garbage = httpx.post(f"{gateway.url}/v1/completions", content=b"{not json", headers=AUTH, timeout=30)
    assert garbage.status_code == 400 and set(garbage.json()["error"]) == {"message", "type", "param", "code"}

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="sk-wrong", max_retries=0).models.list()
    anonymous = httpx.post(f"{gateway.url}/v1/completions", json={"prompt": "Hi"}, timeout=30)
    assert anonymous.status_code == 401 and anonymous.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{gateway.url}/health").json() == {"status": "ok"}
    assert httpx.post(f"{gateway.url}/admin/restart").status_code == 401
    metrics = httpx.get(f"{gateway.url}/metrics").text
    for name in ("warmgate:requests_total", "warmgate:engines", "warmgate:weight_loads_total",
                 "warmgate:e2e_request_latency_seconds", "warmgate:time_to_first_token_seconds"):  # fmt: skip
        assert name in metrics, name
    assert 'warmgate:weight_loads_total{source="ipc"}' in metrics


class Load:
    """16 clients, half streaming, sending short completions until stopped; every outcome counted."""

    def __init__(self, gateway: Gateway, clients: int = 16) -> None:
        self.gateway = gateway
        self.stop = threading.Event()
        self.outcomes: Counter[str] = Counter()
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=180)
        assert not any(t.is_alive() for t in self.threads), "a client hung"

    def _record(self, outcome: str, error: str | None = None) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if error:
                self.errors.append(error)

    def _run(self, i: int) -> None:
        # Each answer checked by the fault suite's checker (tests/fault/load.py): a stream counts only with its usage,
        # every token and [DONE], no error event; a whole answer with every token and finish_reason "length".
        stream = i % 2 == 1
        with httpx.Client(base_url=self.gateway.url, headers=AUTH, timeout=120) as http:
            while not self.stop.is_set():
                outcome = send(http, stream, max_tokens=8, client=i)
                if outcome.ok:
                    self._record("stream_ok" if stream else "ok")
                else:
                    self._record("failed", f"failed {'stream' if stream else 'plain'}: {outcome.error}")

    def snapshot(self) -> Counter[str]:
        with self.lock:
            return Counter(self.outcomes)

    def wait_for_more(self, n: int, timeout: float = 120.0) -> None:
        """Until ``n`` more requests have completed (either way) than now."""
        target = sum(self.snapshot().values()) + n
        deadline = time.monotonic() + timeout
        while sum(self.snapshot().values()) < target:
            assert time.monotonic() < deadline, f"the load made no progress: {dict(self.snapshot())}"
            time.sleep(0.05)


def test_no_dropped_requests_across_restarts_reload_and_crashes(gateway: Gateway, model: Path) -> None:
    # The checkpoint's tensor data is overwritten from here on (header, size and mtime kept): every
    # engine from now must take its weights from the cache, or its answers would change.
    reference = gateway.client().completions.create(model=MODEL_NAME, prompt="The capital of France is",
                                                    max_tokens=8, temperature=0)  # fmt: skip
    _scramble_tensor_data(model / "model.safetensors")

    reports = []
    with Load(gateway) as load:
        load.wait_for_more(8)  # every client is in its loop before the first restart
        for i in range(6):  # twenty more, with standbys: tests/test_standby.py
            strategy = "overlap" if i % 2 == 0 else "replace"
            response = gateway.admin("POST", "/admin/restart", json={"strategy": strategy})
            assert response.status_code == 200, response.text
            reports.append(response.json())
        # A reload that changes an engine setting rolls the engines over on the same weights.
        write_config(gateway.config, model, max_num_seqs=4)
        reload = gateway.admin("POST", "/admin/reload")
        assert reload.status_code == 200 and reload.json()["changed"] == "engine" and reload.json()["ok"], reload.text
        load.wait_for_more(8)  # requests served by the reloaded engine count too
        calm = load.snapshot()
        assert calm["failed"] == 0, load.errors[:5]

        # Three crashes of the active engine under the same load.
        for _ in range(3):
            victim = gateway.active_pid()
            assert victim is not None
            os.kill(victim, signal.SIGKILL)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if gateway.active_pid() not in (None, victim):
                    break
                time.sleep(0.2)
            else:
                pytest.fail("no replacement engine after a crash")
            load.wait_for_more(12)  # the replacement serves for a while before the next crash
    outcomes = load.snapshot()

    assert all(r["ok"] and r["weight_source"] == "ipc" for r in reports), reports
    assert {r["strategy"] for r in reports} == {"overlap", "replace"}
    for report in reports:
        # A promoted standby started earlier: its report has no start-up phases of its own.
        started = () if report["path"] == "standby" else ("spawn", "init", "weight_load", "warmup")
        # `replace` drains the old engine before the switch; `overlap` answers at the switch, the drain goes on.
        drained = ("drain",) if report["strategy"] == "replace" else ()
        for phase in (*started, "probe", "switch", *drained, "total"):
            assert phase in report["phases"], (phase, report)
        assert report["drained"] is (None if drained else False), report
    assert {r["path"] for r in reports} <= {"standby", "fork"}, "every new engine was forked or promoted"
    # Requests in flight on a crashed engine are resumed on its replacement: none fails, no stream is cut.
    assert outcomes["failed"] == 0, load.errors[:5]
    assert outcomes["ok"] > 0 and outcomes["stream_ok"] > 0
    print(f"\nload outcomes: {dict(outcomes)}")

    status = gateway.admin("GET", "/admin/status").json()
    active = next(e for e in status["engines"] if e["id"] == status["active"])
    assert active["settings"]["max_num_seqs"] == 4 and active["weight_source"] == "ipc"
    # The engine's memory plan (on the CPU from the settings alone): what it runs with, as /health says.
    memory = active["memory"]
    assert memory["max_num_seqs"] == 4 and memory["device"] is None and memory["kv_tokens"] > 0, memory
    restarts = status["restarts"]
    assert [r["reason"] for r in restarts[-3:]] == ["crash"] * 3 and all(r["ok"] for r in restarts[-3:])
    assert status["cache"]["attach_count"] >= 1 + len(reports) + 1 + 3
    after = gateway.client().completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=8,
                                                temperature=0)  # fmt: skip
    assert after.choices[0].text == reference.choices[0].text  # the cache's weights, not the scrambled file
    metrics = httpx.get(f"{gateway.url}/metrics").text
    assert 'warmgate:engine_restarts_total{ok="true",reason="crash"} 3.0' in metrics
    assert 'warmgate:weight_loads_total{source="disk"}' not in metrics  # every engine attached
    assert "warmgate:engine_crashes_total 3.0" in metrics

    # An invalid config changes nothing; the engine keeps serving.
    gateway.config.write_text("[engine]\nmax_num_seqs = 0\n")
    refused = gateway.admin("POST", "/admin/reload")
    assert refused.status_code == 400 and "max_num_seqs" in refused.json()["error"]["message"]
    assert gateway.admin("GET", "/admin/status").json()["active"] == status["active"]
    write_config(gateway.config, model, max_num_seqs=4)


def _scramble_tensor_data(path: Path) -> None:
    """Overwrite everything after the safetensors header, keeping size and mtime (the cache key's view)."""
    stat = path.stat()
    with path.open("r+b") as f:
        header_len = int.from_bytes(f.read(8), "little")
        f.seek(8 + header_len)
        remaining = stat.st_size - 8 - header_len
        block = b"\x7f" * (1 << 20)
        while remaining > 0:
            n = min(remaining, len(block))
            f.write(block[:n])
            remaining -= n
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def _metrics(gateway: Gateway) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{gateway.url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_hostile_input_gets_openai_errors_never_a_5xx(gateway: Gateway) -> None:
    def post(path: str, content: bytes | str) -> httpx.Response:
        headers = {**AUTH, "content-type": "application/json"}
        return httpx.post(f"{gateway.url}{path}", content=content, headers=headers, timeout=60)

    def error(response: httpx.Response, status: int, *words: str) -> None:
        assert response.status_code == status, response.text
        body = response.json()["error"]
        assert set(body) >= {"message", "type", "code"} and all(w in body["message"] for w in words), body

    lone = '{"model": "demo", "max_tokens": 2, "prompt": "Hi \\ud800 there"}'  # a lone surrogate escape
    error(post("/v1/completions", lone), 400, "not valid Unicode")
    chat = '{"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": "\\udfff"}]}'
    error(post("/v1/chat/completions", chat), 400, "not valid Unicode")
    error(post("/v1/completions", "[" * 100_000 + "]" * 100_000), 400, "nested too deeply")
    # Fields the gateway acts on itself are checked by it: a truthy string is not a stream.
    wrong = post("/v1/completions", '{"model": "demo", "prompt": "Hi", "stream": "yes please"}')
    error(wrong, 400, "stream", "boolean")
    assert wrong.json()["error"]["param"] == "stream" and wrong.headers["content-type"] == "application/json"
    error(post("/v1/chat/completions", b"x" * (9 * 2**20)), 413, "exceeds the limit")
    # Under the body limit but far beyond the context: refused before the 2 MB are tokenized.
    huge = json.dumps({"model": "demo", "max_tokens": 2, "prompt": "word " * 400_000})
    error(post("/v1/completions", huge), 400, "maximum context length", "at least")
    error(httpx.get(f"{gateway.url}/v1/nowhere", headers=AUTH), 404, "Not Found")
    error(httpx.get(f"{gateway.url}/v1/completions", headers=AUTH), 405, "Method Not Allowed")
    typo = gateway.admin("POST", "/admin/restart", content=b"[" * 50_000)
    error(typo, 400, "nested too deeply")
    # And the gateway serves on.
    assert gateway.client().completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).usage is not None


NOT_HONOURED = {  # OpenAI parameters the engine does not act on yet: each must be refused, never silently ignored
    "functions": [{"name": "get_weather", "parameters": {"type": "object"}}],
    "function_call": "auto",
    "logit_bias": {"42": 5},
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
}


@pytest.mark.parametrize("param", sorted(NOT_HONOURED))
def test_a_parameter_that_is_not_honoured_is_refused_by_name(gateway: Gateway, param: str) -> None:
    """Through the official client: a 400 whose param names the field, not a 200 with free text."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    with pytest.raises(openai.BadRequestError) as refused:
        gateway.client().chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4,
                                                 **{param: NOT_HONOURED[param]})  # type: ignore[call-overload]  # fmt: skip
    body = refused.value.body
    assert isinstance(body, dict) and body.get("param") == param and body.get("type") == "invalid_request_error", body
    assert "not supported" in body["message"], body
    # What asks for nothing is accepted: plain text, no tools.
    plain = gateway.client().chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2,
                                                     response_format={"type": "text"}, tool_choice="none")  # fmt: skip
    assert plain.choices[0].message.content is not None and not plain.choices[0].message.tool_calls


def test_a_stopped_cache_process_stalls_neither_requests_nor_the_status_page(gateway: Gateway) -> None:
    cache_pid = gateway.admin("GET", "/admin/status").json()["cache"]["pid"]
    answers: list[httpx.Response] = []
    served_meanwhile = 0

    os.kill(cache_pid, signal.SIGSTOP)
    try:
        asking = threading.Thread(target=lambda: answers.append(gateway.admin("GET", "/admin/status")))
        asking.start()
        # The status call waits for the stopped cache (its timeout, seconds); requests go on meanwhile. Every
        # answer here came while the cache was stopped (it runs again only after the loop), whether the status call
        # had answered by then or not: on CI's loaded cores a 2-token answer took longer than the status call's wait.
        while asking.is_alive() or not served_meanwhile:
            answer = gateway.client().completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2)
            if answer.usage is not None:
                served_meanwhile += 1
        asking.join(timeout=60)
    finally:
        os.kill(cache_pid, signal.SIGCONT)
    assert answers and answers[0].status_code == 200 and "error" in answers[0].json()["cache"], answers
    assert served_meanwhile >= 1, "no request was served while the cache was stopped"
    assert "error" not in gateway.admin("GET", "/admin/status").json()["cache"]  # answers again once it runs


def test_metrics_agree_with_what_clients_saw(gateway: Gateway) -> None:
    chat, text = "/v1/chat/completions", "/v1/completions"
    before = _metrics(gateway)
    usages, first_token = [], {}
    long_prompt = "Tell me about the sea. " * 40  # prefill takes a while: time to the role chunk != TTFT
    for route, body in [(chat, {"messages": [{"role": "user", "content": long_prompt}]}),
                        (text, {"prompt": long_prompt})]:  # fmt: skip
        # 64 tokens whatever the model would say: the engine is still generating when the gauge is
        # read at the first token, even on a loaded machine (with 12 the relay could have written the whole answer).
        body = {**body, "model": MODEL_NAME, "max_tokens": 64, "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        start = time.perf_counter()
        with httpx.stream("POST", f"{gateway.url}{route}", json=body, headers=AUTH, timeout=120) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if route not in first_token and chunk["choices"]:
                    choice = chunk["choices"][0]
                    if choice.get("text") or choice.get("delta", {}).get("content"):
                        first_token[route] = time.perf_counter() - start
                        running = _metrics(gateway)["warmgate:num_requests_running"]
                        assert running == 1, "a stream being relayed is a running request"
                if chunk.get("usage"):
                    usages.append(chunk["usage"])
    whole = gateway.client().completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=5, temperature=0)
    usages.append(whole.usage.model_dump())
    # A relay counts a request once its last byte is written: the client may read that byte and ask for /metrics
    # (maybe of another relay) before the counting coroutine resumes. Read until the three requests are counted.
    done = [f'warmgate:requests_total{{route="{route}",status="200"}}' for route in (chat, text)]

    def counted() -> dict[str, float] | None:
        read = _metrics(gateway)
        return read if [read.get(n, 0) - before.get(n, 0) for n in done] == [1, 2] else None

    after = wait_for(counted, 10, "one chat and two completion requests counted as 200s in /metrics")

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert after["warmgate:num_requests_running"] == 0
    assert grew("warmgate:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert grew("warmgate:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    for route in (chat, text):
        label = f'{{route="{route}"}}'
        assert grew(f"warmgate:time_to_first_token_seconds_count{label}") == (2 if route == text else 1)
    # The chat stream's TTFT is the time to its first token, not to the role chunk sent before prefill.
    chat_ttft = grew(f'warmgate:time_to_first_token_seconds_sum{{route="{chat}"}}')
    assert 0.5 * first_token[chat] < chat_ttft <= first_token[chat], (chat_ttft, first_token)


def test_status_restart_and_reload_commands_print_summaries_and_json(gateway: Gateway) -> None:
    def cli(*args: str) -> str:  # the address and the token come from the run dir
        cmd = [sys.executable, "-m", "app.cli", *args, "--run-dir", str(gateway.run_dir)]
        run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        return run.stdout

    status = json.loads(cli("status", "--json"))  # the document, as /admin/status gives it
    assert status["active"] is not None and status["cache"]["bytes"] > 0 and status["restarts"]
    summary = cli("status")
    assert f"model    {status['model']}" in summary
    cache = status["cache"]
    assert f"{cache['device']}  {cache['bytes'] / 2**20:.1f} MiB" in summary and f"pid {cache['pid']}" in summary
    active = next(e for e in status["engines"] if e["id"] == status["active"])
    row = next(line.split() for line in summary.splitlines() if line.startswith(f"{active['id']} "))
    assert row[:4] == [str(active["id"]), "active", str(active["pid"]), "ipc"], row
    settings_line = next(line for line in summary.splitlines() if line.startswith("engine   "))
    assert f"max_num_seqs={active['settings']['max_num_seqs']}" in settings_line.split()  # the settings in use
    memory_line = next(line for line in summary.splitlines() if line.startswith("memory   "))
    assert f"max_model_len={active['memory']['max_model_len']}" in memory_line.split(), memory_line
    supervisor, relays = status["supervisor"]["pid"], len(status["relays"])
    processes = f"serve pid {gateway.proc.pid}  supervisor pid {supervisor}  {relays} relays"
    assert f"gateway  {processes}" in summary
    last = status["restarts"][-1]
    assert f"  {last['reason']}  {last['strategy']}  engine {last['engine']}" in summary
    for phase in last["phases"]:  # one line per phase, its duration beside it; the total on the restart's line
        assert phase == "total" or any(line.split()[0] == phase for line in summary.splitlines() if line), phase

    restart = cli("restart", "--strategy", "overlap", "--wait", "drained")
    head, *phases = restart.strip().splitlines()
    assert head.startswith("ok  ") and "  admin  overlap  engine " in head and " total " in head, restart
    assert {line.split()[0] for line in phases} >= {"probe", "switch", "drain"}, restart
    quick = cli("restart", "--strategy", "overlap")  # the default: the answer at the switch, the drain goes on
    assert "the old engine drains on" in quick and "drain " not in quick.replace("drains on", ""), quick
    reload = json.loads(cli("reload", "--json"))  # reload's text: test_admin_text.py
    assert reload["changed"] is None and reload["ok"] and reload["applied"] == [] and reload["pending"] == []

    # What the CLI could not read is named, in one line.
    env = {**os.environ, "WARMGATE_ADMIN_TOKEN": ""}
    for args, said in ((["--run-dir", "/nonexistent"], "no gateway address in /nonexistent/address"),
                       (["--url", gateway.url, "--run-dir", "/nonexistent"],
                        "no admin token in /nonexistent/admin-token")):  # fmt: skip
        cmd = [sys.executable, "-m", "app.cli", "status", *args]
        bad = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
        assert bad.returncode == 2 and bad.stderr.startswith(f"warmgate: error: {said}"), bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _supervisor(gateway: Gateway) -> int:
    """The supervisor's pid: the child of `warmgate serve` that starts the fork server, relays and spawned engines."""
    return int(gateway.status()["supervisor"]["pid"])


def _fork_server_pid(gateway: Gateway) -> int | None:
    """The gateway's fork server: its child titled so (forked engines take titles of their own; their parent is the
    fork server)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
                title = b" ".join(cmdline)  # its process title (common/proctitle.py): "warmgate: fork server RUN_DIR"
                if b"warmgate: fork server" in title and _ppid(int(entry.name)) == _supervisor(gateway):
                    return int(entry.name)
            except OSError:
                continue
    return None


def _listening(path: Path) -> bool:
    """Something accepts connections on the Unix socket (a killed server's socket file does not)."""
    import socket

    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def test_a_reload_rotates_api_keys_without_a_restart(gateway: Gateway) -> None:
    assert gateway.config is not None
    engines = [(e["id"], e["pid"]) for e in gateway.status()["engines"]]
    text = gateway.config.read_text()  # the config the gateway started with (the fixture): only the key changes
    gateway.config.write_text(text.replace(API_KEY, "sk-rotated"))
    try:
        reload = gateway.admin("POST", "/admin/reload")
        assert reload.status_code == 200 and reload.json()["changed"] is None, reload.text
        assert reload.json()["applied"] == ["gateway.api_keys"] and reload.json()["pending"] == [], reload.text
        body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1}
        old = httpx.post(f"{gateway.url}/v1/completions", json=body, headers=AUTH, timeout=60)
        assert old.status_code == 401 and old.json()["error"]["type"] == "authentication_error", old.text
        new = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=60,
                         headers={"authorization": "Bearer sk-rotated"})  # fmt: skip
        assert new.status_code == 200, new.text
        assert [(e["id"], e["pid"]) for e in gateway.status()["engines"]] == engines, "no engine was restarted"
    finally:
        gateway.config.write_text(text)
        assert gateway.admin("POST", "/admin/reload").json()["ok"]


def test_engines_are_forked_from_the_fork_server_and_spawned_while_it_is_gone(gateway: Gateway) -> None:
    forks = _fork_server_pid(gateway)
    assert forks is not None and _ppid(forks) == _supervisor(gateway)

    def fresh_restart(tokens: int) -> dict[str, Any]:  # another config: no standby matches, an engine starts
        return gateway.admin("POST", "/admin/restart", json={"engine": {"default_max_tokens": tokens}}).json()

    report = fresh_restart(255)
    assert report["ok"] and report["path"] == "fork", report
    assert _ppid(gateway.active_pid()) == forks, "the active engine is the fork server's child"
    os.kill(forks, signal.SIGKILL)
    report = fresh_restart(254)
    assert report["ok"] and report["path"] == "spawn", report  # no fork server: the gateway spawns
    assert _ppid(gateway.active_pid()) == _supervisor(gateway)
    deadline = time.monotonic() + 120
    while (_fork_server_pid(gateway) in (None, forks)) or not _listening(gateway.run_dir / "fork.sock"):
        assert time.monotonic() < deadline, "the fork server was not started again"
        time.sleep(0.2)
    report = fresh_restart(256)
    assert report["ok"] and report["path"] == "fork", report
    reply = gateway.client().completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3, temperature=0)
    assert reply.choices[0].text
    # An override stays for the restarts that follow, until a reload (or other overrides); the report says so.
    plain = gateway.admin("POST", "/admin/restart").json()
    assert plain["ok"] and plain["overrides"] == {"default_max_tokens": 256}, plain
    active = next(e for e in gateway.status()["engines"] if e["id"] == plain["engine"])
    assert active["settings"]["default_max_tokens"] == 256
    cleared = gateway.admin("POST", "/admin/restart", json={"engine": {}}).json()  # none: the file's settings again
    assert cleared["ok"] and cleared["overrides"] == {}, cleared


def test_a_failed_start_leaves_the_engine_serving_and_sighup_reloads(gateway: Gateway, model: Path) -> None:
    before = gateway.admin("GET", "/admin/status").json()["active"]
    # An engine that cannot start (no room for one sequence in its KV cache) is reported; nothing changes.
    failed = gateway.admin("POST", "/admin/restart", json={"engine": {"kv_cache_bytes": 1}})
    assert failed.status_code == 422 and failed.json()["ok"] is False
    error = failed.json()["error"]  # the worker's own error, in one line (not a joined log tail)
    assert "exited with 2 during start-up: warmgate: error: kv_cache_bytes=1 cannot hold one sequence" in error
    assert "\n" not in error and " | " not in error, error
    assert failed.json()["overrides"] == {}  # a failed restart's overrides are not kept
    assert "level=WARNING logger=warmgate.supervisor.engines event=restart reason=admin" in gateway.log_path.read_text()
    assert gateway.admin("GET", "/admin/status").json()["active"] == before
    assert gateway.client().completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).usage is not None
    # With `replace` the old engine is gone before the new one fails: the last good config comes back.
    failed = gateway.admin("POST", "/admin/restart", json={"strategy": "replace", "engine": {"kv_cache_bytes": 1}})
    assert failed.status_code == 422 and failed.json()["ok"] is False
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        restarts = gateway.admin("GET", "/admin/status").json()["restarts"]
        if restarts[-1]["reason"] == "replace failed" and restarts[-1]["ok"]:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"no recovery after a failed replace: {restarts[-2:]}")
    assert gateway.client().completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).usage is not None
    bad = gateway.admin("POST", "/admin/restart", json={"strategy": "sideways"})
    assert bad.status_code == 400 and "sideways" in bad.json()["error"]["message"]
    typo = gateway.admin("POST", "/admin/restart", json={"engine": {"max_num_seq": 4}})
    assert typo.status_code == 400 and "max_num_seq: Extra inputs" in typo.json()["error"]["message"], typo.text
    keyed = gateway.admin("POST", "/admin/restart", json={"engine": {"dtype": "bfloat16"}})  # other cached weights
    assert keyed.status_code == 400 and "dtype needs other cached weights" in keyed.json()["error"]["message"]

    # SIGHUP re-reads the file: a new default max_tokens shows in behaviour, not only in status.
    write_config(gateway.config, model, max_num_seqs=4, default_max_tokens=3)
    gateway.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status = gateway.admin("GET", "/admin/status").json()
        active = next((e for e in status["engines"] if e["id"] == status["active"]), None)
        if active and active["settings"]["default_max_tokens"] == 3:
            break
        time.sleep(0.2)
    else:
        pytest.fail("SIGHUP did not roll the engines over")
    body = {"prompt": "Count:", "ignore_eos": True}
    response = httpx.post(f"{gateway.url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert response.json()["usage"]["completion_tokens"] == 3
    logged = "event=reload signal=SIGHUP changed=engine ok=True"  # written once the old engine has drained
    deadline = time.monotonic() + 60
    while logged not in gateway.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert logged in gateway.log_path.read_text()


def test_a_client_that_hangs_up_stops_its_generation_in_the_engine(gateway: Gateway) -> None:
    status = gateway.admin("GET", "/admin/status").json()
    engine_socket = next(e["socket"] for e in status["engines"] if e["id"] == status["active"])
    engine = httpx.Client(transport=httpx.HTTPTransport(uds=engine_socket), base_url="http://engine", timeout=30)

    def running() -> int:
        return int(engine.get("/health").json()["running"])

    body = {"prompt": "Count:", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 400 tokens on this CPU
        httpx.post(f"{gateway.url}/v1/completions", json=body, headers=AUTH, timeout=1.5)
    deadline = time.monotonic() + 10
    while running() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running() == 0, "the engine kept generating for a client that left"
    left = 'warmgate:requests_total{route="/v1/completions",status="499"}'
    assert _metrics(gateway)[left] >= 1

    # A client that leaves in the middle of its stream is counted as one that left (499), not as a 200.
    before = _metrics(gateway)[left]
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=30) as response:  # fmt: skip
        assert response.status_code == 200
        lines = response.iter_lines()
        while not next(lines).startswith("data: {"):  # the first token: the stream has begun
            pass
    wait_for(lambda: _metrics(gateway)[left] == before + 1, 10, "the stream a client left counted as 499")
    wait_for(lambda: running() == 0, 10, "the generation of the stream its client left stopped")


def test_a_reload_that_changes_the_model_loads_it_in_a_new_cache_then_swaps(gateway: Gateway, demo_path) -> None:
    old = gateway.admin("GET", "/admin/status").json()
    other = demo_path("fp8-channel")
    write_config(gateway.config, other, max_num_seqs=4)
    reload = gateway.admin("POST", "/admin/reload")
    assert reload.status_code == 200 and reload.json()["changed"] == "model" and reload.json()["ok"], reload.text
    assert reload.json()["weight_source"] == "ipc"
    new = gateway.admin("GET", "/admin/status").json()
    assert new["model"] == str(other.resolve()) and new["cache"]["key"] != old["cache"]["key"]
    assert new["cache"]["pid"] != old["cache"]["pid"]
    with pytest.raises(ProcessLookupError):  # the old cache process is gone
        for _ in range(100):
            os.kill(old["cache"]["pid"], 0)
            time.sleep(0.1)
    answer = gateway.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0
    )
    assert "Paris" in (answer.choices[0].message.content or "")

    # Same model, another dtype: another cache key, so another cache; the replaced one stops.
    write_config(gateway.config, other, max_num_seqs=4, dtype="bfloat16")
    reload = gateway.admin("POST", "/admin/reload")
    assert reload.status_code == 200 and reload.json()["changed"] == "cache" and reload.json()["ok"], reload.text
    assert reload.json()["weight_source"] == "ipc"
    newest = gateway.admin("GET", "/admin/status").json()
    assert newest["cache"]["key"] not in (old["cache"]["key"], new["cache"]["key"])
    with pytest.raises(ProcessLookupError):
        for _ in range(100):
            os.kill(new["cache"]["pid"], 0)
            time.sleep(0.1)
