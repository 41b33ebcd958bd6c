"""The cache process and engine attach, as real processes on real sockets (CPU: sealed memfd arenas).

The four-path check of the weight-cache daemons: disk load -> ipc-or-disk with no cache
(falls back) -> ipc attach in a fresh engine -> a second ipc attach in another fresh engine
while the first still runs; identical greedy outputs on all four, and the IPC engines' weights
are the cache's bytes (the same memfd, no private copy).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from processes import (
    REPO,
    Process,
    Worker,
    check_attached_share_one_copy,
    generate,
    health,
    memfd_arenas,
    proc_status,
    start_cache,
    start_worker,
    wait_for,
)
from safetensors.torch import load_file, save_file

from cache.arena import attach_arena, tensor_views
from cache.checkpoint.reader import read_checkpoint
from cache.checkpoint.synth import synth_checkpoint
from cache.client import CacheClient, CacheRefused, CacheUnavailable
from cache.manifest import cache_key, expected_key
from cache.processors.native import FP8_DEQUANT, process_checkpoint


# fp8-tensor takes the fp8-channel path on CPU (dequantized once, a scalar scale instead of a column): not repeated.
@pytest.mark.parametrize("scheme", ["fp8-block", "fp8-channel", "bf16"])
def test_four_paths_give_identical_outputs_from_one_copy(scheme: str, demo_path, tmp_path: Path) -> None:
    model = demo_path(scheme)
    workers: list[Worker] = []
    cache: Process | None = None
    try:
        disk = start_worker(tmp_path, model, "disk")
        workers.append(disk)
        outputs = {"disk": generate(disk)}
        disk_anon = proc_status(disk.pid)["RssAnon"]
        assert health(disk)["weights"] == {"source": "disk", "key": None, "lease": None, "fallbacks": 0,
                                           "fallback_reason": None, "attach_phases": {}}  # fmt: skip
        disk.stop()

        # ipc-or-disk with no cache process: loads from disk, and says why.
        absent = tmp_path / "run" / "cache.sock"
        fallback = start_worker(tmp_path, model, "fallback", weights="ipc-or-disk", cache_socket=absent)
        workers.append(fallback)
        outputs["fallback"] = generate(fallback)
        weights = health(fallback)["weights"]
        assert weights["source"] == "disk" and weights["fallbacks"] == 1
        assert "CacheUnavailable" in weights["fallback_reason"], weights
        assert "event=weights_fallback policy=ipc-or-disk" in fallback.log()
        fallback.stop()

        cache = start_cache(tmp_path, model)
        with CacheClient(cache.socket) as client:
            stats = client.stats()
        assert len(memfd_arenas(cache.pid)) == 1 and stats.leases == [] and stats.arenas == 1

        first = start_worker(tmp_path, model, "ipc1", weights="ipc", cache_socket=cache.socket)
        workers.append(first)
        outputs["ipc1"] = generate(first)
        second = start_worker(tmp_path, model, "ipc2", weights="ipc", cache_socket=cache.socket)
        workers.append(second)
        outputs["ipc2"] = generate(second)

        arena_bytes = check_attached_share_one_copy(cache, [first, second], outputs, disk_anon)
        for worker in (first, second):
            # Shared memory: the arena, plus a few MB of other shared pages.
            assert proc_status(worker.pid)["RssShmem"] <= arena_bytes + (16 << 20)
            assert "event=startup phase=weight_load" in worker.log()

        for worker in (first, second):
            worker.stop()
        with CacheClient(cache.socket) as client:
            wait_for(lambda: client.stats().leases == [], 10, "leases outlived their engines")
    finally:
        for worker in workers:
            worker.stop()
        if cache is not None:
            cache.stop()


def test_attached_tensors_and_layer_metadata_match_processing(demo_path, tmp_path: Path) -> None:
    """Every cached tensor equals what the engine's own processing produces, and the per-layer
    metadata says what the checkpoint is (block 128x128, weights [N, K], dynamic activations)."""
    model = demo_path("fp8-block")
    cache = start_cache(tmp_path, model)
    try:
        with CacheClient(cache.socket, name="test") as client:
            lease, manifest, fds = client.attach("test")
            arena = attach_arena(manifest.arenas[0].transport, fds[0], manifest.arenas[0].size, torch.device("cpu"))
            for fd in fds:
                os.close(fd)
            views = tensor_views(arena.buffer(), manifest.tensors)
            ckpt = read_checkpoint(model)
            expected = process_checkpoint(ckpt, torch.device("cpu"), torch.float32)
            assert manifest.key == cache_key(ckpt, torch.device("cpu"), torch.float32)
            assert manifest.key == expected_key(model, torch.device("cpu"), torch.float32)  # metadata alone
            assert set(views) == set(expected.tensors)
            for name, tensor in expected.tensors.items():
                assert torch.equal(views[name], tensor), name
            assert all(e.offset % 256 == 0 for e in manifest.tensors)
            assert set(manifest.recipes()) == set(expected.recipes)
            qkv = manifest.layers["model.layers.0.self_attn.qkv_proj"]
            assert qkv["weight"] == "fp8-block" and qkv["block_size"] == [128, 128]
            assert qkv["weight_layout"] == "NK" and qkv["input_scale"] == "dynamic"
            assert qkv["activations"] == "dynamic-per-token-group-128" and qkv["kernel"] == FP8_DEQUANT
            assert [p[0] for p in qkv["parts"]] == [f"model.layers.0.self_attn.{n}_proj" for n in "qkv"]
            assert manifest.recipes() == expected.recipes
            # Nobody can write to the arena: the memfd is sealed against writable mappings.
            with pytest.raises(PermissionError):
                fd = client.attach("writer")[2][0]
                try:
                    mmap.mmap(fd, manifest.arenas[0].size, flags=mmap.MAP_SHARED,
                              prot=mmap.PROT_READ | mmap.PROT_WRITE)  # fmt: skip
                finally:
                    os.close(fd)
            client.release(lease)
            with pytest.raises(CacheRefused, match="UnknownLease"):
                client.release(lease)
    finally:
        cache.stop()


def test_key_mismatch_is_refused_and_ipc_or_disk_falls_back(demo_path, tmp_path: Path) -> None:
    from engine.config import EngineConfig
    from engine.native.llm_engine import LLMEngine
    from engine.weights import WeightKeyMismatch

    cache = start_cache(tmp_path, demo_path("fp8-block"))
    try:
        other_checkpoint = {"model": demo_path("fp8-channel")}
        other_recipe = {"model": demo_path("fp8-block"), "dtype": "bfloat16"}  # the cache processed for float32
        for change in (other_checkpoint, other_recipe):
            base = {"max_num_seqs": 1, "max_model_len": 64, "cache_socket": cache.socket, **change}
            with pytest.raises(WeightKeyMismatch, match="key"):
                LLMEngine(EngineConfig(**base, weights="ipc"))
            engine = LLMEngine(EngineConfig(**base, weights="ipc-or-disk"))
            assert engine.weight_source == "disk"
            assert engine.weights.fallback_reason is not None
            assert engine.weights.fallback_reason.startswith("WeightKeyMismatch")
        with CacheClient(cache.socket) as client:
            stats = client.stats()
        assert stats.attach_count == 0 and stats.leases == [], "a mismatched engine must not take a lease"

        # A worker told to use the cache (ipc) with the wrong checkpoint exits with one clear line.
        sock = tmp_path / "mismatch.sock"
        config = json.dumps(
            {"model": str(demo_path("fp8-channel")), "weights": "ipc", "cache_socket": str(cache.socket)}
        )
        run = subprocess.run([sys.executable, "-m", "app.cli", "engine", "--socket", str(sock), "--config", config],
                             cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert run.returncode == 2, run.stderr
        last = run.stderr.strip().splitlines()[-1]
        assert last.startswith("warmgate: error:") and "expects" in last and "Traceback" not in run.stderr
    finally:
        cache.stop()


def test_kill_9_of_an_attached_engine_frees_its_lease(demo_path, tmp_path: Path) -> None:
    model = demo_path("fp8-block")
    cache = start_cache(tmp_path, model)
    workers = []
    try:
        victim = start_worker(tmp_path, model, "victim", weights="ipc", cache_socket=cache.socket)
        workers.append(victim)
        before = generate(victim)
        with CacheClient(cache.socket) as client:
            assert [lease.pid for lease in client.stats().leases] == [victim.pid]
            victim.proc.kill()
            victim.proc.wait()
            wait_for(lambda: client.stats().leases == [], 10, "the killed engine's lease was not cleaned")
        successor = start_worker(tmp_path, model, "successor", weights="ipc", cache_socket=cache.socket)
        workers.append(successor)
        assert generate(successor) == before
        with CacheClient(cache.socket) as client:
            stats = client.stats()
        assert [lease.pid for lease in stats.leases] == [successor.pid] and stats.attach_count == 2
        assert cache.proc.poll() is None
    finally:
        for worker in workers:
            worker.stop()
        cache.stop()


def _block_64_checkpoint(root: Path) -> Path:
    """A genuine 64x64-block FP8 checkpoint: config and scale shapes agree with each other."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "max_position_embeddings": 256,
    }  # fmt: skip
    path = synth_checkpoint(root / "block64", config, "fp8-block", progress=False)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["block_structure"] = [64, 64]
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        n, k = tensors[name.removesuffix("_scale")].shape
        tensors[name] = torch.ones(math.ceil(n / 64), math.ceil(k / 64))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_a_64x64_block_checkpoint_is_rejected_before_anything_is_served(tmp_path: Path) -> None:
    model = _block_64_checkpoint(tmp_path)
    sock = tmp_path / "run" / "cache.sock"
    run = subprocess.run([sys.executable, "-m", "app.cli", "cache", "--model", str(model), "--socket", str(sock)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2, run.stderr
    lines = [line for line in run.stderr.splitlines() if not line.startswith("ts=")]
    assert len(lines) == 1 and lines[0].startswith("warmgate: error:"), run.stderr
    assert "block_structure" in lines[0] and "[64, 64]" in lines[0] and "128" in lines[0], lines[0]
    assert "event=ready" not in run.stderr
    assert not sock.exists(), "a rejected checkpoint must not leave a socket behind"


def test_peers_of_another_uid_do_not_get_in(demo_path, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("dropping privileges to another uid needs root (CI and the dev machine run as root)")
    # Every ancestor of the run dir must let the other user through, or the test proves nothing:
    # pytest's own temporary directories are 0700.
    base = Path(tempfile.mkdtemp(prefix="warmgate-peer-"))
    base.chmod(0o711)
    cache = start_cache(base, demo_path("fp8-block"))
    try:
        assert stat.S_IMODE(cache.socket.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(cache.socket.stat().st_mode) == 0o600
        assert as_another_user(cache.socket) == "PermissionError"  # the 0700 directory stops it first
        # Open the file-system layer on purpose: the peer-uid check still refuses.
        cache.socket.parent.chmod(0o755)
        cache.socket.chmod(0o666)
        assert as_another_user(cache.socket) == "refused PeerRefused"
        assert "event=refused" in cache.log() and "peer_uid=65534" in cache.log()
        assert cache.proc.poll() is None
    finally:
        cache.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_garbage_on_the_cache_socket_gets_a_protocol_error_and_the_cache_serves_on(demo_path, tmp_path: Path) -> None:
    """No root needed: what a confused or hostile local peer sends is refused, in the error shape, one by one."""
    cache = start_cache(tmp_path, demo_path("fp8-block"))
    try:

        def raw_exchange(payload: bytes) -> dict[str, Any] | None:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(10)
                s.connect(str(cache.socket))
                s.sendall(payload)
                s.shutdown(socket.SHUT_WR)
                data = b"".join(iter(lambda: s.recv(65536), b""))
            if not data:
                return None
            (length,) = struct.unpack("!I", data[:4])
            return json.loads(data[4 : 4 + length])  # type: ignore[no-any-return]

        def frame(body: bytes) -> bytes:
            return struct.pack("!I", len(body)) + body

        garbage = {
            b"GET / HTTP/1.1\r\n\r\n": "ProtocolError",  # an HTTP client at the wrong socket: absurd length
            struct.pack("!I", 2**31) + b"x": "ProtocolError",
            frame(b"\xff\xfe not json"): "ProtocolError",
            frame(b"[1, 2, 3]"): "ProtocolError",
            frame(b'{"op": "format_disk"}'): "BadRequest",
            frame(b'{"op": "release", "lease": "all"}'): "BadRequest",
            frame(b'{"op": "hello", "protocol": 99}'): "VersionMismatch",
            frame(b'{"no": "op"}'): "BadRequest",
            struct.pack("!I", 100) + b"{}": "ProtocolError",  # cut short
            b"\x00": "ProtocolError",  # half a header
        }
        for payload, kind in garbage.items():
            reply = raw_exchange(payload)
            assert reply is not None and reply["ok"] is False and reply["error"]["type"] == kind, (payload, reply)
        assert raw_exchange(b"") is None  # connect and hang up: nothing to answer
        with CacheClient(cache.socket) as client:
            assert client.stats().attach_count == 0
        assert cache.proc.poll() is None
    finally:
        cache.stop()


def as_another_user(sock: Path, uid: int = 65534) -> str:
    """Ask the cache for stats from a forked child that dropped to ``uid`` (nobody); returns what happened."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop privileges for good, try, report, and leave without cleanup handlers
        outcome = "child failed"
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            CacheClient(sock).stats()
            outcome = "allowed"
        except CacheUnavailable as exc:
            outcome = "PermissionError" if "ermission" in str(exc) else f"unavailable {exc}"
        except CacheRefused as exc:
            outcome = f"refused {exc.kind}"
        finally:
            os.write(write_end, outcome.encode())
            os._exit(0)
    os.close(write_end)
    try:
        return os.read(read_end, 4096).decode()
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)


def test_sigterm_stops_the_cache_and_attached_mappings_stay_valid(demo_path, tmp_path: Path) -> None:
    cache = start_cache(tmp_path, demo_path("fp8-block"))
    with CacheClient(cache.socket) as client:
        _, manifest, fds = client.attach("survivor")
        arena = attach_arena(manifest.arenas[0].transport, fds[0], manifest.arenas[0].size, torch.device("cpu"))
        for fd in fds:
            os.close(fd)
        views = tensor_views(arena.buffer(), manifest.tensors)
        before = views["model.embed_tokens.weight"].sum().item()
        cache.proc.send_signal(signal.SIGTERM)
        assert cache.exit_code(timeout=30) == 0
    assert not cache.socket.exists()
    assert "event=exit" in cache.log()
    assert views["model.embed_tokens.weight"].sum().item() == before  # the memfd lives while mapped
    with pytest.raises(CacheUnavailable):
        CacheClient(cache.socket)


def test_cache_refuses_a_socket_directory_open_to_others(demo_path, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    run = subprocess.run([sys.executable, "-m", "app.cli", "cache", "--model", str(demo_path("bf16")),
                          "--socket", str(shared / "cache.sock")], cwd=REPO, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert run.returncode == 2
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("warmgate: error: socket directory") and "0700" in last, run.stderr
