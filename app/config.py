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

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from common.settings import EngineSettings
from engine.config import EngineConfig


class ConfigError(ValueError):
    """The config file or the environment is invalid; the message is one readable line."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GatewaySettings(_Section):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    api_keys: list[str] = []  # empty: no key needed
    admin_token: str | None = None  # none: generated at start into the run dir (mode 0600)
    max_body_bytes: Annotated[int, Field(ge=1024)] = 8 * 2**20  # a larger request body gets 413
    workers: Annotated[int | None, Field(ge=1, le=64)] = None  # relay processes; none: cores / 8, from 2 to 8
    # Requests the relays forward to an engine beyond its max_num_seqs (the rest wait in the relays);
    # none: a quarter of max_num_seqs, at least 4.
    engine_backlog: Annotated[int | None, Field(ge=0)] = None

    def relay_count(self) -> int:
        """Relays cost more CPU per token the more of them share a load (each wakes up for fewer events: 27.8, 32.6
        and 34.2 us per token for 1, 2 and 4 relays at 128 streams, docs/benchmarks.md), and one relay carries some
        35,000 tokens/s per core, several engines' worth: a few suffice. Two at least, so that one can die."""
        return self.workers or min(8, max(2, (os.cpu_count() or 2) // 8))


class RestartSettings(_Section):
    strategy: Literal["overlap", "replace"] = "overlap"
    start_timeout: Annotated[float, Field(gt=0)] = 300.0  # seconds for a new engine to answer its probe
    drain_timeout: Annotated[float, Field(ge=0)] = 30.0  # seconds an old engine may finish in-flight requests
    queue_timeout: Annotated[float, Field(gt=0)] = 60.0  # seconds a request waits for an engine slot before 503
    max_queue: Annotated[int, Field(ge=1)] = 1024  # requests waiting in one relay for an engine slot before 503
    crash_backoff: Annotated[float, Field(gt=0)] = 0.5  # first wait before restarting a crashed engine; doubles
    crash_backoff_max: Annotated[float, Field(gt=0)] = 30.0
    request_resumes: Annotated[int, Field(ge=0)] = 3  # moves of one request to another engine after its failed
    fork_server: bool = True  # fork engines from a process that has imported torch (else spawn each one)
    standby: Annotated[int, Field(ge=0, le=8)] = 1  # fully started engines kept for the next restart or crash
    health_interval: Annotated[float, Field(gt=0)] = 1.0  # seconds between /health polls of each engine
    health_timeout: Annotated[float, Field(gt=0)] = 10.0  # an engine silent this long is killed and replaced


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="WARMGATE_", env_nested_delimiter="__", extra="forbid")

    model: Path | None = None  # none: the demo checkpoint (fp8-block)
    served_model_name: str | None = None
    run_dir: Path = Path("/tmp/warmgate")  # sockets, logs, admin token; 0700
    cache_device: str | None = None  # where the cache keeps weights; default: the engines' device
    gateway: GatewaySettings = GatewaySettings()
    engine: EngineSettings = EngineSettings()
    restart: RestartSettings = RestartSettings()

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
                            cache_socket=cache_socket)  # fmt: skip


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
