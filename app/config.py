"""Gateway settings: a TOML file, WARMGATE_* environment variables over it, command-line flags over both,
validated by pydantic.

    [gateway]            host, port, api_keys, admin_token, workers, engine_backlog
    [engine]             device, dtype, max_num_seqs, max_model_len, kv_cache_bytes, weights, ...
    [restart]            strategy (overlap | replace), start_timeout, drain_timeout, queue_timeout, ...
    model = "/path"      default: the demo checkpoint (fp8-block), built on first use

Environment: ``WARMGATE_ADMIN_TOKEN``, ``WARMGATE_MODEL``, and nested fields with a double
underscore, e.g. ``WARMGATE_ENGINE__MAX_NUM_SEQS=8``.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from common.settings import EngineSettings
from engine.config import EngineConfig


class ConfigError(ValueError):
    """The config file or the environment is invalid; the message is one readable line."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GatewaySettings(_Section):
    host: Annotated[str, Field(description="address to listen on (0.0.0.0: every interface)")] = "127.0.0.1"
    port: Annotated[
        int, Field(ge=0, le=65535, description="port to listen on; 0: any free port, recorded in RUN_DIR/address")
    ] = 8000
    api_keys: Annotated[list[str], Field(description="keys clients send as bearer tokens; empty: no key needed")] = []
    admin_token: Annotated[
        str | None,
        Field(
            description="bearer token of the admin API; none: WARMGATE_ADMIN_TOKEN, else one generated at start "
            "into RUN_DIR/admin-token (mode 0600)"
        ),
    ] = None
    max_body_bytes: Annotated[int, Field(ge=1024, description="a larger request body gets 413")] = 8 * 2**20
    workers: Annotated[
        int | None, Field(ge=1, le=32, description="relay processes; none: an eighth of the cores, from 2 to 8")
    ] = None
    engine_backlog: Annotated[
        int | None,
        Field(
            ge=0,
            description="requests the relays forward to an engine beyond its max_num_seqs (the rest wait in the "
            "relays); none: a quarter of max_num_seqs, at least 4",
        ),
    ] = None

    def relay_count(self) -> int:
        """Relays cost more CPU per token the more of them share a load (each wakes up for fewer events: 32.8, 36.0
        and 39.6 us per token for 1, 2 and 4 relays at 128 stub streams on CPU; 20.9 against 34.6 us for 2 and 8
        relays on the H200: docs/benchmarks.md), and one relay carries tens of thousands of tokens per second per
        core, several engines' worth: a few suffice. Two at least, so that one can die."""
        return self.workers or min(8, max(2, (os.cpu_count() or 2) // 8))


class RestartSettings(_Section):
    strategy: Annotated[
        Literal["overlap", "replace"],
        Field(description="overlap: start the new engine, switch, then drain the old one; replace: drain first"),
    ] = "overlap"
    start_timeout: Annotated[
        float, Field(gt=0, description="seconds a new engine gets to answer /health, and again to answer its probe")
    ] = 300.0
    drain_timeout: Annotated[
        float, Field(ge=0, description="seconds an old engine (or, at shutdown, a relay) may finish in-flight requests")
    ] = 30.0
    queue_timeout: Annotated[
        float, Field(gt=0, description="seconds a request waits for an engine slot before 503")
    ] = 60.0
    max_queue: Annotated[
        int, Field(ge=1, description="requests waiting in one relay for an engine slot before 503")
    ] = 1024
    crash_backoff: Annotated[
        float, Field(gt=0, description="first wait (seconds) before restarting a crashed engine; doubles")
    ] = 0.5
    crash_backoff_max: Annotated[float, Field(gt=0, description="longest wait (seconds) of that backoff")] = 30.0
    request_resumes: Annotated[
        int, Field(ge=0, description="moves of one request to another engine after its engine failed")
    ] = 3
    fork_server: Annotated[
        bool, Field(description="fork engines from a process that has imported torch (else spawn each one)")
    ] = True
    standby: Annotated[
        int | None,
        Field(
            ge=0,
            le=8,
            description="fully started engines kept for the next restart or crash; none: 2 where native engines run "
            "on CUDA (a standby holds no KV cache there until promoted), else 1",
        ),
    ] = None
    health_interval: Annotated[float, Field(gt=0, description="seconds between reads of each engine's heartbeat")] = 1.0
    health_timeout: Annotated[
        float, Field(gt=0, description="seconds of heartbeat silence after which an engine is killed and replaced")
    ] = 10.0

    @property
    def standbys(self) -> int:
        """``standby`` as Settings resolved it (1 for a section made on its own with none)."""
        return 1 if self.standby is None else self.standby


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="WARMGATE_", env_nested_delimiter="__", extra="forbid")

    model: Annotated[
        Path | None, Field(description="checkpoint directory; none: the fp8-block demo checkpoint, built on first use")
    ] = None
    served_model_name: Annotated[
        str | None, Field(description="the model's name in the API; none: the checkpoint directory's name")
    ] = None
    run_dir: Annotated[
        Path, Field(description="sockets, logs, admin token, address (mode 0700); one gateway at a time")
    ] = Path("/tmp/warmgate")
    cache_device: Annotated[
        str | None, Field(description="where the cache keeps the weights; none: the engines' device")
    ] = None
    gateway: GatewaySettings = GatewaySettings()
    engine: EngineSettings = EngineSettings()
    restart: RestartSettings = RestartSettings()

    @model_validator(mode="after")
    def _standbys(self) -> Settings:
        """``restart.standby`` unset: two where native engines run on CUDA, so that a second restart or crash in a
        row finds one ready while the first is rebuilt (a standby there costs its context and graphs, not a KV
        cache: engine/native/kv_memory.py); one elsewhere."""
        if self.restart.standby is None:
            two = self.engine.backend == "native" and _engines_on_cuda(self.engine.device)
            self.restart = self.restart.model_copy(update={"standby": 2 if two else 1})
        return self

    @field_validator("run_dir")
    @classmethod
    def _absolute(cls, run_dir: Path) -> Path:
        """Absolute, symbolic links resolved: the processes of a gateway name its run dir in their titles, which
        is how `warmgate stop` finds them (common/processes.py), whatever directory it is run from."""
        return run_dir.expanduser().resolve()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)  # load_settings layers the file, the environment and the command line

    def engine_config(self, model: Path, cache_socket: Path, overrides: dict[str, Any] | None = None) -> EngineConfig:
        """The config of one engine worker.

        ``overrides`` are checked like the file: an unknown key or a bad value raises ValidationError.
        """
        engine = EngineSettings.model_validate({**self.engine.model_dump(), **(overrides or {})})
        return EngineConfig(**engine.model_dump(), model=model, served_model_name=self.served_model_name,
                            cache_socket=cache_socket, kv_share=self.kv_share, engines=self.engines_on_device,
                            reserve_kv=True)  # fmt: skip

    @property
    def engines_on_device(self) -> int:
        """Engines on the device at once: the active one, the standbys, and with overlap restarts the one still
        draining (engine/memory_plan.py counts a CUDA context and working memory for each)."""
        return 1 + self.restart.standbys + (self.restart.strategy == "overlap")

    @property
    def kv_share(self) -> int:
        """Engines that hold a KV cache on the device at once (engine/memory_plan.py divides what is left for KV
        caches by it): the active one and with overlap restarts the one still draining. A native engine standing
        by holds none until it is promoted (engine/native/kv_memory.py); one of the vLLM backend holds its own."""
        standbys = self.restart.standbys if self.engine.backend == "vllm" else 0
        return 1 + standbys + (self.restart.strategy == "overlap")


def _engines_on_cuda(device: str) -> bool:
    """Whether engines with this ``engine.device`` run on CUDA, without importing torch (the CLI reads settings
    too): "auto" is CUDA where the NVIDIA driver lists a GPU that CUDA_VISIBLE_DEVICES does not hide."""
    if device != "auto":
        return device.startswith("cuda")
    if os.environ.get("CUDA_VISIBLE_DEVICES", "0").strip() in ("", "-1"):
        return False
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def load_settings(path: Path | None, **overrides: Any) -> Settings:
    """Settings from a TOML file (optional), the WARMGATE_* environment over it, and command-line ``overrides``
    (dotted keys, None for a flag not given) over both; ConfigError names what is wrong."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(path.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    flags: dict[str, Any] = {}
    for key, value in overrides.items():
        if value is not None:
            section, _, field = key.partition(".")
            if field:
                flags.setdefault(section, {})[field] = value
            else:
                flags[key] = value
    try:
        environment = EnvSettingsSource(Settings)()  # WARMGATE_* as pydantic-settings reads them, nested
        return Settings(**_layered(data, environment, flags))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{path or 'settings'}: {where}: {first['msg']}") from None


def _layered(*layers: dict[str, Any]) -> dict[str, Any]:
    """The layers merged, each over the ones before it; sections ([engine], ...) merged key by key."""
    merged: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = _layered(merged[key], value)
            else:
                merged[key] = value
    return merged
