"""The router's configuration: one TOML file decoded into frozen Structs.

Every field has a default, so an empty file (or none) is a working config;
unknown keys are errors, so a typo is caught at startup, not ignored. The
command line overrides fields after decoding (:func:`with_overrides`). Example::

    [server]
    host = "0.0.0.0"
    port = 8000
    drain_timeout = 30

    [routing]
    policy = "least_loaded"      # resolved through policies.registry
    options = {}                 # its factory's keyword arguments (or a [routing.options] table)

    [auth]
    keys = { "sk-team-a" = "tenant-a" }

    [[backends]]
    url = "http://10.0.0.5:8000"
    kind = "openai"              # "openai" | "engine" | "mock"
    name = "gpu-a"
    weight = 2
    options = { http = "1.1", api_key_env = "GPU_A_KEY", stall_timeout = 30 }
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

__all__ = [
    "AuthConfig",
    "BackendSpec",
    "ConfigError",
    "HealthConfig",
    "RouterConfig",
    "RoutingConfig",
    "ServerConfig",
    "apply_settings",
    "decode_config",
    "load_config",
    "with_overrides",
]

Positive = Annotated[float, Meta(gt=0)]
PositiveInt = Annotated[int, Meta(gt=0)]
Port = Annotated[int, Meta(ge=0, le=65535)]
BackendKind = Literal["openai", "engine", "mock"]


class ConfigError(Exception):
    """The configuration is invalid; the message says where and why."""


class _Base(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class ServerConfig(_Base, frozen=True, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: Port = 8000
    certfile: str | None = None
    keyfile: str | None = None
    drain_timeout: Positive = 30.0  # seconds streams may run on after SIGTERM
    max_body_bytes: PositiveInt = 4 * 1024 * 1024
    access_log: bool = False
    workers: PositiveInt | None = None  # router processes on the port (SO_REUSEPORT); None: one per core
    keep_alive_max_requests: PositiveInt | None = None  # requests before a client connection is closed; None: never


class RoutingConfig(_Base, frozen=True, kw_only=True, forbid_unknown_fields=True):
    policy: str = "round_robin"  # a routing policy's name in policies.registry
    # Keyword arguments for the policy's factory ([routing.options]); the
    # policy validates them (policies.registry.create).
    options: dict[str, Any] = {}
    max_attempts: PositiveInt = 3  # backends tried before the first token
    retry_after: Positive = 1.0  # seconds suggested to clients when no backend is up


class HealthConfig(_Base, frozen=True, kw_only=True, forbid_unknown_fields=True):
    interval: Positive = 2.0  # seconds between probes of one backend
    timeout: Positive = 2.0  # a probe slower than this counts as failed
    unhealthy_threshold: PositiveInt = 2  # consecutive failed probes that take an up backend down
    restart_backoff: Positive = 0.1  # first delay before restarting a crashed actor
    restart_backoff_max: Positive = 10.0


class AuthConfig(_Base, frozen=True, kw_only=True, forbid_unknown_fields=True):
    keys: dict[str, str] = {}  # API key -> tenant; empty: no authentication


class BackendSpec(_Base, frozen=True, kw_only=True, forbid_unknown_fields=True):
    url: str | None = None  # None: in-process (mock)
    kind: BackendKind = "openai"
    name: str | None = None  # default: derived from kind and position
    weight: Positive = 1.0
    model: str | None = None  # the model name served (mocks) or asked for (HTTP backends)
    # Adapter settings: an HTTP backend's backends.openai_http.HTTPOptions
    # ({http = "1.1", api_key_env = "KEY", stall_timeout = 30, ...}), a
    # mock's backends.mock.MockConfig ({tpot_s = 0.05}).
    options: dict[str, Any] = {}


class RouterConfig(_Base, frozen=True, kw_only=True, forbid_unknown_fields=True):
    server: ServerConfig = ServerConfig()
    routing: RoutingConfig = RoutingConfig()
    health: HealthConfig = HealthConfig()
    auth: AuthConfig = AuthConfig()
    backends: tuple[BackendSpec, ...] = ()

    def backend_names(self) -> list[str]:
        return [spec.name or f"{spec.kind}-{i}" for i, spec in enumerate(self.backends)]


def decode_config(raw: dict[str, Any]) -> RouterConfig:
    """Type-check a parsed TOML document; raise ConfigError naming the field."""
    try:
        config = msgspec.convert(raw, RouterConfig, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid configuration: {exc}") from None
    _check(config)
    return config


def load_config(path: str | Path | None) -> RouterConfig:
    """Read and decode ``path``; ``None`` gives the defaults."""
    if path is None:
        return RouterConfig()
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path} is not valid TOML: {exc}") from None
    try:
        return decode_config(raw)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def apply_settings(config: RouterConfig, settings: list[str]) -> RouterConfig:
    """``--set section.field=value`` overrides, applied in order: a dotted
    path into the config (``routing.max_attempts=5``, ``backends.0.options.http="1.1"``,
    ``auth.keys={ "sk-1" = "team-a" }``); the value is read as a TOML value,
    and as a plain string when it is not one (``server.host=0.0.0.0``)."""
    doc: dict[str, Any] = msgspec.to_builtins(config)
    doc["backends"] = list(doc["backends"])  # a tuple in the Struct
    for setting in settings:
        path, sep, text = setting.partition("=")
        keys = [k for k in path.strip().split(".") if k]
        if not sep or not keys:
            raise ConfigError(f"--set {setting!r}: expected section.field=value")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
        node: Any = doc
        for key in keys[:-1]:
            node = _step(node, key, setting)
        last = keys[-1]
        if isinstance(node, list):
            node[_index(node, last, setting)] = value
        elif isinstance(node, dict):
            node[last] = value
        else:
            raise ConfigError(f"--set {setting!r}: {'.'.join(keys[:-1])} is inside a value, not a section")
    return decode_config(doc)


def _index(node: list[Any], key: str, setting: str) -> int:
    if not key.isdigit() or int(key) >= len(node):
        raise ConfigError(f"--set {setting!r}: no list entry {key!r} (there are {len(node)})")
    return int(key)


def _step(node: Any, key: str, setting: str) -> Any:
    """One step down the path; a section not there yet is made (decoding then
    names it if the config has no such field)."""
    if isinstance(node, list):
        return node[_index(node, key, setting)]
    if not isinstance(node, dict):
        raise ConfigError(f"--set {setting!r}: {key!r} is inside a value, not a section")
    return node.setdefault(key, {})


def with_overrides(config: RouterConfig, **fields: Any) -> RouterConfig:
    """Replace fields given on the command line (``None`` = not given).
    ``backends`` replaces the list; any other name is looked up in the
    ``server``, ``routing`` and ``health`` sections, in that order."""
    doc = msgspec.to_builtins(config)
    for key, value in fields.items():
        if value is None:
            continue
        if key == "backends":
            doc["backends"] = msgspec.to_builtins(value)
            continue
        section = next((name for name, cls in _SECTIONS.items() if key in cls.__struct_fields__), None)
        if section is None:
            raise ConfigError(f"no configuration field named {key!r}")
        doc[section][key] = value
    return decode_config(doc)


_SECTIONS: dict[str, type[_Base]] = {"server": ServerConfig, "routing": RoutingConfig, "health": HealthConfig}


def _check(config: RouterConfig) -> None:
    names = config.backend_names()
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"backend names must be unique; repeated: {', '.join(dupes)}")
    for name, spec in zip(names, config.backends, strict=True):
        if spec.kind != "mock" and not spec.url:
            raise ConfigError(f"backend {name!r}: kind {spec.kind!r} needs a url")
        if spec.url is not None and not spec.url.startswith(("http://", "https://")):
            raise ConfigError(f"backend {name!r}: url must start with http:// or https://")
    if (config.server.certfile is None) != (config.server.keyfile is None):
        raise ConfigError("server.certfile and server.keyfile go together")
