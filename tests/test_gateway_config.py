"""Gateway settings: TOML file, WARMGATE_* environment over it, command-line flags over both, one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.config import ConfigError, load_settings


def test_environment_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "warmgate.toml"
    config.write_text('model = "/models/a"\n[engine]\nmax_num_seqs = 8\ndevice = "cpu"\n[gateway]\nport = 9000\n')
    monkeypatch.setenv("WARMGATE_ENGINE__MAX_NUM_SEQS", "32")
    monkeypatch.setenv("WARMGATE_RESTART__STRATEGY", "replace")
    settings = load_settings(config)
    assert settings.engine.max_num_seqs == 32 and settings.restart.strategy == "replace"
    assert settings.gateway.port == 9000 and settings.model == Path("/models/a")
    engine = settings.engine_config(Path("/models/a"), Path("/run/cache.sock"), {"max_num_seqs": 2})
    assert engine.max_num_seqs == 2 and engine.cache_socket == Path("/run/cache.sock")
    assert engine.weights == "ipc-or-disk"


def test_the_command_line_overrides_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As in the images, which set WARMGATE_GATEWAY__HOST and __PORT: `warmgate serve --port` must still win.
    config = tmp_path / "warmgate.toml"
    config.write_text('[gateway]\nport = 9000\nhost = "10.0.0.1"\n[engine]\nmax_num_seqs = 8\n')
    monkeypatch.setenv("WARMGATE_GATEWAY__PORT", "9100")
    monkeypatch.setenv("WARMGATE_GATEWAY__HOST", "0.0.0.0")
    settings = load_settings(config, **{"gateway.port": 9200, "gateway.host": None, "model": None})
    assert (settings.gateway.port, settings.gateway.host) == (9200, "0.0.0.0")  # flag, then environment
    assert settings.engine.max_num_seqs == 8  # the file's, in the same section as nothing else set
    with pytest.raises(ConfigError, match=r"gateway\.port"):
        load_settings(config, **{"gateway.port": 70000})


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[engine]\nmax_num_seqs = 0\n", ["engine.max_num_seqs", "greater than or equal to 1"]),
        ("[restart]\nstrategy = 'sideways'\n", ["restart.strategy", "overlap"]),
        ("[engin]\nmax_num_seqs = 2\n", ["engin", "Extra inputs"]),
        ("model = [1, 2\n", ["not valid TOML"]),
    ],
)
def test_invalid_files_are_refused_with_one_line(tmp_path: Path, text: str, words: list[str]) -> None:
    config = tmp_path / "warmgate.toml"
    config.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_settings(config)
    message = str(error.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_the_gateway_and_the_workers_share_one_definition_of_engine_settings(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from common.settings import EngineSettings
    from engine.config import EngineConfig

    settings = load_settings(None)
    assert type(settings.engine) is EngineSettings and issubclass(EngineConfig, EngineSettings)
    # What the gateway hands a worker is exactly what a worker accepts, defaults included.
    worker = EngineConfig.model_validate(settings.engine_config(Path("/models/a"), Path("/run/cache.sock")))
    assert worker.model_dump(include=set(EngineSettings.model_fields)) == settings.engine.model_dump()
    # An override with a typo (an admin restart's body) is refused, naming the key; so is a bad value.
    with pytest.raises(ValidationError) as typo:
        settings.engine_config(Path("/models/a"), Path("/run/cache.sock"), {"max_num_seq": 4})
    assert typo.value.errors()[0]["loc"] == ("max_num_seq",)
    with pytest.raises(ValidationError):
        settings.engine_config(Path("/models/a"), Path("/run/cache.sock"), {"max_num_seqs": 0})
    # A worker with no cache configured reads the checkpoint under ipc-or-disk; `ipc` needs the cache.
    assert EngineConfig(model=tmp_path).weights == "ipc-or-disk"
    with pytest.raises(ValidationError, match="needs cache_socket"):
        EngineConfig(model=tmp_path, weights="ipc")


@pytest.mark.parametrize(("engine", "standby", "expected"), [
    ({"device": "cpu"}, None, 1),
    ({"device": "cuda"}, None, 2),
    ({"device": "cuda:1"}, None, 2),
    ({"device": "cuda", "backend": "vllm"}, None, 1),  # a vLLM standby holds its own KV cache
    ({"device": "cuda"}, 0, 0),
    ({"device": "cpu"}, 3, 3),
])  # fmt: skip
def test_two_standbys_by_default_where_native_engines_run_on_cuda(
        tmp_path: Path, engine: dict[str, str], standby: int | None, expected: int) -> None:  # fmt: skip
    """A native standby on CUDA costs its context and graphs, not a KV cache (engine/native/kv_memory.py): two are
    kept unless the settings say otherwise, so that a second restart or crash in a row finds one ready."""
    config = tmp_path / "warmgate.toml"
    lines = ["[engine]", *(f'{key} = "{value}"' for key, value in engine.items())]
    if standby is not None:
        lines += ["[restart]", f"standby = {standby}"]
    config.write_text("\n".join(lines) + "\n")
    settings = load_settings(config)
    assert settings.restart.standby == settings.restart.standbys == expected
    assert settings.engines_on_device == 1 + expected + 1  # and one draining (overlap)


def test_auto_counts_as_cuda_only_where_the_driver_lists_a_visible_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from app.config import _engines_on_cuda

    gpus = Path("/proc/driver/nvidia/gpus")
    present = gpus.is_dir() and any(gpus.iterdir())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _engines_on_cuda("auto") is present
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert _engines_on_cuda("auto") is False
    assert _engines_on_cuda("cpu") is False and _engines_on_cuda("cuda:0") is True
