"""What a Kubernetes inference router reads from a gateway's /metrics (the Gateway API Inference Extension's
model-server protocol, with vLLM's names), checked against the engine's own /health on a real gateway (CPU,
the demo): more streams than the engine runs at once, so that some run, some wait in the engine and the rest
wait in the relays; then none. Also: after a restart with another block size the figures are the new engine's;
the vLLM backend's come from vLLM's scheduler and block pool (in .venv-vllm); a heartbeat file of the earlier
layout (an engine adopted across an upgrade) reads as no load.

    vllm:num_requests_running   sequences running in the engines
    vllm:num_requests_waiting   requests waiting in the relays (warmgate:num_requests_waiting) + in the engines
    vllm:kv_cache_usage_perc    the active engine's KV blocks in use / its usable blocks
    vllm:cache_config_info      block_size and num_gpu_blocks labels, value 1
    vllm:prefix_cache_queries   counters: prompt tokens looked up in / taken from the engines' prefix caches, all
    vllm:prefix_cache_hits      engines so far (warmgate:prefix_cache_*: the supervisor adds them up)
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from processes import Gateway, start_gateway, wait_for
from prometheus_client.parser import text_string_to_metric_families

from common.heartbeat import LOAD_END, SIZE, Heartbeat

MODEL_NAME = "demo"
MAX_NUM_SEQS = 2
BACKLOG = 1  # requests the relays forward to the engine beyond max_num_seqs: they wait in its scheduler
IN_RELAYS = 3  # the rest wait in the relays
BLOCK_SIZE = 8  # not the default (16): the metric must carry the engine's own
# Each answer is long enough (ignore_eos) that none finishes while the test looks: the demo decodes two sequences
# at well under 1000 tokens a second on this machine's two cores.
MAX_TOKENS = 1000
ROUTER = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
          "vllm:cache_config_info", "vllm:lora_requests_info")  # fmt: skip


@pytest.fixture(scope="module")
def gateway(demo_path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    root = tmp_path_factory.mktemp("router")
    config = (
        f'model = "{demo_path("fp8-block")}"\nserved_model_name = "{MODEL_NAME}"\n\n'
        f"[gateway]\nengine_backlog = {BACKLOG}\nworkers = 2\n\n"
        f"[engine]\nmax_num_seqs = {MAX_NUM_SEQS}\nmax_model_len = 1024\nblock_size = {BLOCK_SIZE}\n\n"
        "[restart]\nstandby = 0\nqueue_timeout = 300\n"
    )
    gw = start_gateway(root, config)
    yield gw
    gw.stop()


def router_metrics(url: str) -> dict[str, tuple[dict[str, str], float]]:
    """The router's families in /metrics: name -> (labels, value) of its one series (each must have one, a gauge)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found: dict[str, tuple[dict[str, str], float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name in (*ROUTER, "warmgate:num_requests_waiting"):
            assert family.type == "gauge" and len(family.samples) == 1, (family.name, family.type, family.samples)
            found[family.name] = (family.samples[0].labels, family.samples[0].value)
    return found


def value(metrics: dict[str, tuple[dict[str, str], float]], name: str) -> float:
    return metrics[name][1]


def engine_health(gateway: Gateway) -> dict[str, Any]:
    """The active engine's own /health, on its socket."""
    status = gateway.status()
    socket = next(e["socket"] for e in status["engines"] if e["id"] == status["active"])
    with httpx.Client(transport=httpx.HTTPTransport(uds=socket), base_url="http://engine", timeout=30) as client:
        return client.get("/health").json()  # type: ignore[no-any-return]


def usable(health: dict[str, Any], backend: str) -> int:
    """The engine's usable KV blocks: vLLM's /health counts its null block too (its usage leaves it out)."""
    return int(health["kv_blocks_total"]) - (1 if backend == "vllm" else 0)


def used(health: dict[str, Any], backend: str) -> float:
    """The fraction of the KV cache in use, as the engine's /health says."""
    return (usable(health, backend) - health["kv_blocks_free"]) / usable(health, backend)


async def _stream(url: str, max_tokens: int) -> None:
    """One streamed completion, read until the test cancels it (the client leaves: the gateway aborts it)."""
    body = {"prompt": "Count: one, two,", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    async with (
        httpx.AsyncClient(base_url=url, timeout=300) as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        async for _ in response.aiter_lines():
            pass
    pytest.fail("a stream ended before the test cancelled it: max_tokens is too small for this machine")


def test_the_router_metrics_follow_the_engine_under_load_and_at_rest(gateway: Gateway) -> None:
    idle = router_metrics(gateway.url)
    labels, one = idle["vllm:cache_config_info"]
    assert one == 1 and labels == {"block_size": str(BLOCK_SIZE), "num_gpu_blocks": str(usable(engine_health(gateway),
                                                                                              "native"))}  # fmt: skip
    # No adapters: the picker skips a series whose adapter lists are both empty.
    assert idle["vllm:lora_requests_info"][0] == {"max_lora": "0", "running_lora_adapters": "",
                                                  "waiting_lora_adapters": ""}  # fmt: skip
    busy_then_at_rest(gateway, "native", MAX_TOKENS)


def busy_then_at_rest(gateway: Gateway, backend: str, max_tokens: int) -> None:
    """Idle, then MAX_NUM_SEQS + BACKLOG + IN_RELAYS streams (each metric checked against the engine's /health),
    then every client gone (all back to 0)."""
    idle = router_metrics(gateway.url)
    assert set(idle) == {*ROUTER, "warmgate:num_requests_waiting"}, idle
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert idle[name] == ({"model_name": MODEL_NAME}, 0.0), (name, idle[name])

    async def scenario() -> None:
        total = MAX_NUM_SEQS + BACKLOG + IN_RELAYS
        streams = [asyncio.create_task(_stream(gateway.url, max_tokens)) for _ in range(total)]
        try:
            await _until(lambda: value(router_metrics(gateway.url), "warmgate:num_requests_waiting") == IN_RELAYS,
                         streams, f"{IN_RELAYS} requests waiting in the relays")  # fmt: skip
            await _until(lambda: engine_health(gateway)["running"] == MAX_NUM_SEQS, streams,
                         f"the engine running {MAX_NUM_SEQS} sequences (its /health)")  # fmt: skip
            # The engine writes its heartbeat after each step: the request it queued last shows once a step ended.
            queued = IN_RELAYS + BACKLOG
            await _until(lambda: value(router_metrics(gateway.url), "vllm:num_requests_waiting") == queued, streams,
                         f"{IN_RELAYS} requests waiting in the relays and {BACKLOG} in the engine")  # fmt: skip
            await _check_busy(gateway, backend)
            # Saturated (requests wait in the engine and in the relays) and still ready: /ready asks the engine
            # nothing, so it does not queue behind them (a 1-token probe there would wait for a 1000-token answer).
            ready = await asyncio.to_thread(httpx.get, f"{gateway.url}/ready", timeout=5)
            assert ready.status_code == 200 and ready.json()["status"] == "ready", ready.text
        finally:
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)

    asyncio.run(scenario())

    # Every client left: the engine aborts their sequences and frees their blocks; the figures say so.
    rest = wait_for(lambda: _at_rest(router_metrics(gateway.url)), 60, "all router metrics back to 0")
    health = engine_health(gateway)
    assert health["running"] == health["waiting"] == 0 and health["kv_blocks_free"] == usable(health, backend)
    assert value(rest, "warmgate:num_requests_waiting") == 0


async def _until(condition: Any, streams: list[asyncio.Task[None]], what: str) -> None:
    for _ in range(1200):
        for task in streams:
            if task.done():
                task.result()  # a stream that failed says why
        if await asyncio.to_thread(condition):
            return
        await asyncio.sleep(0.1)
    pytest.fail(f"{what} within 120 s")


async def _check_busy(gateway: Gateway, backend: str) -> None:
    """Six streams on an engine of two sequences and a backlog of one: two run, one waits in the engine, three
    wait in the relays; the KV cache in use lies between what the engine said just after and a step before just
    before (the heartbeat is written after each step, and a step adds at most a block to each sequence)."""
    before = await asyncio.to_thread(engine_health, gateway)
    busy = await asyncio.to_thread(router_metrics, gateway.url)
    after = await asyncio.to_thread(engine_health, gateway)
    assert before["running"] == after["running"] == MAX_NUM_SEQS, (before, after)
    assert before["waiting"] == after["waiting"] == BACKLOG, (before, after)
    assert value(busy, "vllm:num_requests_running") == MAX_NUM_SEQS, busy
    assert value(busy, "warmgate:num_requests_waiting") == IN_RELAYS, busy
    assert value(busy, "vllm:num_requests_waiting") == IN_RELAYS + BACKLOG, busy
    # Two sequences that only grow (none finishes, none is preempted): their blocks in use only grow too.
    usage = value(busy, "vllm:kv_cache_usage_perc")
    kv_before, kv_after = used(before, backend), used(after, backend)
    a_step = MAX_NUM_SEQS / usable(before, backend)  # a block for each running sequence, at most
    assert kv_before > 0 and kv_before - a_step <= usage <= kv_after < 1, (kv_before, usage, kv_after)
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert busy[name][0] == {"model_name": MODEL_NAME}


def _at_rest(metrics: dict[str, tuple[dict[str, str], float]]) -> dict[str, tuple[dict[str, str], float]] | None:
    names = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")
    return metrics if all(value(metrics, n) == 0 for n in names) else None


def test_the_router_metrics_follow_the_active_engine_across_a_restart(gateway: Gateway) -> None:
    """A restart with another block size: the metrics describe the new engine (the relays map its heartbeat file)."""
    first = engine_health(gateway)
    restart = gateway.admin("POST", "/admin/restart", json={"engine": {"block_size": 4}})
    assert restart.status_code == 200 and restart.json()["ok"], restart.text
    health = engine_health(gateway)
    assert health["kv_blocks_total"] != first["kv_blocks_total"]  # twice the blocks, of half the size
    labels, _ = router_metrics(gateway.url)["vllm:cache_config_info"]
    assert labels == {"block_size": "4", "num_gpu_blocks": str(health["kv_blocks_total"])}


def prefix_counters(url: str) -> tuple[float, float]:
    """vllm:prefix_cache_queries and _hits (counters) in /metrics."""
    found = {family.name: family for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    values = []
    for name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
        family = found[name]
        assert family.type == "counter" and [s.name for s in family.samples] == [name + "_total"], family
        assert family.samples[0].labels == {"model_name": MODEL_NAME}
        values.append(family.samples[0].value)
    return values[0], values[1]


def test_the_prefix_cache_counters_add_up_every_engine_and_keep_growing_across_a_restart(gateway: Gateway) -> None:
    """The same prompt twice: the second takes its full blocks from the cache; the counters are the engine's own
    (its /health), and a restart does not take them back: they add the next engine's."""
    prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 6)  # several KV blocks

    def complete() -> None:
        answer = httpx.post(f"{gateway.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=120)
        assert answer.status_code == 200, answer.text

    def settled(expected: tuple[int, int]) -> tuple[float, float] | None:
        counters = prefix_counters(gateway.url)
        return counters if counters == expected else None

    def quiet() -> tuple[float, float] | None:
        """The counters once the supervisor has read everything the engine did (health_interval is 1 s)."""
        seen = prefix_counters(gateway.url)
        time.sleep(1.5)
        return seen if prefix_counters(gateway.url) == seen else None

    before = wait_for(quiet, 30, "the prefix-cache counters at rest")
    first = engine_health(gateway)
    complete()
    complete()
    health = engine_health(gateway)
    grew = (health["prefix_cache_queries"] - first["prefix_cache_queries"],
            health["prefix_cache_hits"] - first["prefix_cache_hits"])  # fmt: skip
    assert grew[0] > 0 and grew[1] > 0, grew  # the second request's full blocks came from the cache
    # The supervisor reads the heartbeat files every second (health_interval).
    now = wait_for(lambda: settled((int(before[0] + grew[0]), int(before[1] + grew[1]))), 30,
                   f"the counters grown by {grew}, as the engine's /health says")  # fmt: skip
    restart = gateway.admin("POST", "/admin/restart", json={})
    assert restart.status_code == 200 and restart.json()["ok"], restart.text
    fresh = engine_health(gateway)  # a new engine: its own counters started again
    complete()
    again = engine_health(gateway)
    more = again["prefix_cache_queries"] - fresh["prefix_cache_queries"]
    assert more > 0
    wait_for(lambda: (c := prefix_counters(gateway.url))[0] >= now[0] + more and c, 30,
             "the new engine's queries added to the counters, the old engine's kept")  # fmt: skip


def test_a_heartbeat_file_of_the_earlier_layout_has_stamps_and_no_load(tmp_path: Path) -> None:
    """An engine started by an earlier gateway (adopted across an upgrade) has a shorter file: it is read, its
    stamps age as before, and it reports no load (the relays then show none for it) rather than failing."""
    path = tmp_path / "engine-1-1.beat"
    path.write_bytes(bytes(3 * 8))
    old = Heartbeat(path)
    old.beat(0)
    old.describe("demo", 16, 100)
    old.publish(1, 2, 3)
    assert old.load() is None and old.ages()[0] < 1 and path.stat().st_size == 3 * 8
    old.close()

    # A load and no prefix-cache counters (the layout before them): the load reads, the counters are zeros.
    loaded = tmp_path / "engine-1-3.beat"
    loaded.write_bytes(bytes(LOAD_END))
    middle = Heartbeat(loaded)
    middle.describe("demo", 16, 100)
    middle.publish(1, 2, 3, 500, 400)
    load = middle.load()
    assert load is not None and load.running == 1 and middle.prefix_cache() == (0, 0)
    assert loaded.stat().st_size == LOAD_END
    middle.close()

    new = Heartbeat.create(tmp_path / "engine-1-2.beat")
    assert new.path.stat().st_size == SIZE and new.load() is None  # nothing described yet
    new.describe("x" * 300, 16, 100)  # a name longer than its room is cut, not spilled into the next slots
    new.publish(2, 5, 40, 640, 512)
    load = new.load()
    assert load is not None and (load.running, load.waiting, load.kv_usage, load.block_size) == (2, 5, 0.4, 16)
    assert load.model_name == "x" * 256 and new.prefix_cache() == (640, 512)
    new.close()


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make test runs the vllm "
                                                                       "tests in .venv-vllm)")  # fmt: skip
def test_the_router_metrics_with_the_vllm_backend(demo_path, tmp_path: Path) -> None:
    """The same figures from vLLM's own scheduler and block pool, and the block size vLLM chose."""
    config = (
        f'model = "{demo_path("bf16")}"\nserved_model_name = "{MODEL_NAME}"\n\n'
        f"[gateway]\nengine_backlog = {BACKLOG}\nworkers = 2\n\n"
        f'[engine]\nbackend = "vllm"\nweights = "ipc"\nmax_num_seqs = {MAX_NUM_SEQS}\nmax_model_len = 512\n'
        f"kv_cache_bytes = {64 << 20}\n\n[restart]\nstandby = 0\nqueue_timeout = 300\nstart_timeout = 300\n"
    )
    shape = json.loads((demo_path("bf16") / "config.json").read_text())
    head_dim = shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]
    per_position = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * 2  # K and V, bf16
    gw = start_gateway(tmp_path, config)
    try:
        labels, _ = router_metrics(gw.url)["vllm:cache_config_info"]
        health = engine_health(gw)
        assert labels["num_gpu_blocks"] == str(usable(health, "vllm"))
        # The block size vLLM chose (not engine.block_size, which it does not read) is the one it sized its cache by.
        assert health["kv_blocks_total"] == (64 << 20) // (int(labels["block_size"]) * per_position), labels
        busy_then_at_rest(gw, "vllm", 480)
    finally:
        gw.stop()
