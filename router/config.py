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

    [[auth.api_keys]]            # keys as SHA-256 digests: printf %s KEY | sha256sum
    sha256 = "8879f6a4ae35c420a15d35fed3b8dd07577207803d404f6d4cc4fa829dafa910"   # sk-team-a
    tenant = "team-a"
    requests_per_minute = 60     # per-key limits, on top of the tenant's

    [tenants.team-a]             # weight in fair sharing, highest class, limits
    weight = 2
    max_priority = "interactive" # X-Priority: interactive | default | batch, capped here
    requests_per_minute = 600
    tokens_per_minute = 200000
    concurrent = 32

    [admission]                  # queue when every backend is at its concurrency
    enabled = true
    policy = "erlang"            # sheds at arrival when the M/M/c wait passes the deadline
    backend_concurrency = 64     # slots per backend (or [[backends]] max_concurrency)
    queue_size = { interactive = 256, default = 256, batch = 1024 }
    queue_timeout = { interactive = 10, default = 30, batch = 120 }

    [priority]
    policy = "fair_queue"
    options = { aging = 10 }     # seconds per class of promotion

    [ratelimit]                  # limits shared by every router on one Redis (default: in memory)
    policy = "redis"
    url = "redis://10.0.0.9:6379/0"

    [breaker]
    policy = "standard"
    options = { consecutive_failures = 5, base_ejection = 30, max_ejection = 300 }

    [retry]
    budget_ratio = 0.2           # retries in flight <= 20% of streams in flight ...
    min_retries = 3              # ... or this many

    [migration]                  # a stream whose backend dies mid-answer continues elsewhere
    max_migrations = 3
    stall_timeout = "auto"       # max(2 x the backend's p99 inter-token latency, 1 s); or seconds

    [[backends]]
    url = "http://10.0.0.5:8000"
    kind = "openai"              # "openai" | "engine" | "mock"
    name = "gpu-a"
    weight = 2
    options = { http = "1.1", api_key_env = "GPU_A_KEY", stall_timeout = 30 }

    [[engines]]                  # local engine replicas (router/engines.py); none: two of the default model
    model = "/models/qwen.gguf"  # GGUF file or Hugging Face folder (default: the installed SmolLM2)
    name = "qwen"                # its replicas' names: qwen-0, qwen-1, ...
    replicas = 2                 # in rotation
    warm = 1                     # loaded and probed, out of rotation: scale-up takes these first
    args = ["--kv-cache-gb", "2"]    # more headrace engine flags

    [[models]]                   # a public model name and how it is served
    name = "chat"
    aliases = ["gpt-4o"]
    backends = ["gpu-a"]         # its group (default: every backend that lists it)
    policy = "least_loaded"      # the group's own policy (default: [routing]'s)
    upstream_model = "llama-3-70b"   # the name sent upstream (default: name)
    fallbacks = ["chat-small"]   # tried in order before the first byte reaches the client

    [[models]]                   # a canary: a split between routes, sticky per conversation
    name = "assistant"
    versions = [{ model = "chat", weight = 95 }, { model = "chat-small", weight = 5 }]

Model routes are checked as a whole (:func:`_check_models`): every name
they mention resolves, the graph of fallbacks and versions has no cycle, and
each route's policy exists and takes its options; the message names the
field (``models[1].fallbacks``).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from policies.registry import PolicyError, create, create_policy, load_factory
from policies.shared_limits import SharedRateLimitPolicy

__all__ = [
    "AdmissionConfig",
    "ApiKey",
    "AuthConfig",
    "BackendSpec",
    "BreakerConfig",
    "CapacityConfig",
    "ClassTable",
    "ConfigError",
    "EngineSpec",
    "HealthConfig",
    "JobsConfig",
    "LoggingConfig",
    "MigrationConfig",
    "ModelRoute",
    "ModelVersion",
    "PolicyConfig",
    "RateLimitConfig",
    "RetryConfig",
    "RouterConfig",
    "RoutingConfig",
    "ServerConfig",
    "TenantConfig",
    "TracingConfig",
    "apply_settings",
    "decode_config",
    "load_config",
    "with_overrides",
]

Positive = Annotated[float, Meta(gt=0)]
NonNegative = Annotated[float, Meta(ge=0)]
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
    # Ingress limits (issue 17; frontend/hardening.py enforces them).
    keep_alive_timeout: Positive = 60.0  # seconds an idle client connection is kept
    body_idle_timeout: Positive = 10.0  # seconds without a request body byte before 408
    write_stall_timeout: Positive = 30.0  # a client that reads nothing this long: stream reset, backend cancelled
    max_concurrent_streams: PositiveInt = 100  # per HTTP/2 connection (advertised); more are refused
    stream_buffer_bytes: PositiveInt = 64 * 1024  # unsent output held per stream before the backend is paused
    connection_buffer_bytes: PositiveInt = 1024 * 1024  # unsent output held per connection
    reset_burst: PositiveInt = 100  # stream resets per connection at once (Rapid Reset) ...
    reset_rate: Positive = 33.0  # ... or per second sustained, before GOAWAY(ENHANCE_YOUR_CALM)
    max_connections: PositiveInt | None = None  # client connections in total; None: 3/4 of the fd limit
    max_connections_per_client: PositiveInt | None = 256  # per client address; None: no cap
    reserved_connections: PositiveInt = 32  # of max_connections, kept for /health /ready /metrics
    # The admin listener: /metrics and /admin/* (and /health, /ready) are
    # served here only, not on the main listener. A non-loopback admin_host
    # needs [auth] admin_sha256 (startup refuses it otherwise).
    admin_host: str = "127.0.0.1"
    admin_port: Port | None = None  # None: port + 1 (a free port when port is 0)
    # HTTP/2 (cleartext and TLS) on frontend/lean_h2.py's protocol, or on
    # hypercorn's (HTTP/1.1 is hypercorn's either way).
    h2_ingress: Literal["hypercorn", "lean"] = "lean"


class RoutingConfig(_Base, frozen=True, kw_only=True, forbid_unknown_fields=True):
    policy: str = "kv_aware"  # a routing policy's name in policies.registry
    # Keyword arguments for the policy's factory ([routing.options]); the
    # policy validates them (policies.registry.create).
    options: dict[str, Any] = {}
    max_attempts: PositiveInt = 3  # backends tried per model of a route's chain, before the first token
    retry_after: Positive = 1.0  # seconds suggested to clients when no backend is up
    # A backend's 429 takes it out of routing for its Retry-After (this long
    # when it gives none), at most max_cooldown seconds.
    cooldown: Positive = 1.0
    max_cooldown: Positive = 60.0
    # Interactive and default traffic leaves backends tagged preemptible or
    # pool = "batch" alone while an untagged one is a candidate.
    interactive_avoids_preemptible: bool = False


class HealthConfig(_Base, frozen=True, kw_only=True, forbid_unknown_fields=True):
    interval: Positive = 2.0  # seconds between probes of one backend
    timeout: Positive = 2.0  # a probe slower than this counts as failed
    unhealthy_threshold: PositiveInt = 2  # consecutive failed probes that take an up backend down
    restart_backoff: Positive = 0.1  # first delay before restarting a crashed actor
    restart_backoff_max: Positive = 10.0


PriorityName = Literal["interactive", "default", "batch"]
SHA256_HEX = Annotated[str, Meta(pattern="^[0-9a-f]{64}$")]


class ApiKey(_Base, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One API key, stored as the hex SHA-256 of the key (never the key)."""

    sha256: SHA256_HEX
    tenant: str
    requests_per_minute: Positive | None = None
    tokens_per_minute: Positive | None = None
    concurrent: PositiveInt | None = None


class AuthConfig(_Base, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Plain API key -> tenant: the old form, still accepted (the router
    # digests them at startup and warns to move them to api_keys).
    keys: dict[str, str] = {}
    api_keys: tuple[ApiKey, ...] = ()  # no keys in either: no authentication
    # The admin key's hex SHA-256: /admin/* then needs Authorization: Bearer
    # <admin key> (an API key is never an admin key). None: /admin/* needs no
    # key, and the admin listener must be bound to a loopback address.
    admin_sha256: SHA256_HEX | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.keys or self.api_keys)


class TenantConfig(_Base, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A tenant's share and limits; a tenant not configured gets these defaults."""

    weight: Positive = 1.0  # its share of tokens under contention
    max_priority: PriorityName = "interactive"  # the highest class it may ask for
    requests_per_minute: Positive | None = None
    tokens_per_minute: Positive | None = None
    concurrent: PositiveInt | None = None


class ClassTable(_Base, frozen=True, kw_only=True, forbid_unknown_fields=True):
    interactive: Positive
    default: Positive
    batch: Positive

    def of(self, name: str) -> float:
        value: float = getattr(self, name)
        return value


class PolicyConfig(_Base, frozen=True, kw_only=True, forbid_unknown_fields=True):
    policy: str
    options: dict[str, Any] = {}


class AdmissionConfig(_Base, frozen=True, kw_only=True, forbid_unknown_fields=True):
    enabled: bool = True
    policy: str = "erlang"  # an admission policy in policies.registry
    options: dict[str, Any] = {}
    backend_concurrency: PositiveInt = 64  # slots per backend without its own max_concurrency
    queue_size: ClassTable = ClassTable(interactive=256, default=256, batch=1024)
    # Seconds a request may wait for a slot; also its deadline for shedding
    # unless the request sends X-Deadline-Ms.
    queue_timeout: ClassTable = ClassTable(interactive=10, default=30, batch=120)
    # Each backend's limit learned from its 429s (AIMD, policies/concurrency.py):
    # a 429 multiplies it by concurrency_backoff, answers at the limit raise it
    # by about one per round trip, never past its max_concurrency.
    learn_concurrency: bool = True
    concurrency_backoff: Annotated[float, Meta(gt=0, le=1)] = 0.5
    # The last reserve_slots free slots of a model group go only to tenants
    # under their weighted share of it (policies.fairness.SlotShares); a tenant
    # that asked within share_window seconds counts as active. 0: none kept.
    reserve_slots: Annotated[int, Meta(ge=0)] = 1
    share_window: NonNegative = 10.0


class RateLimitConfig(PolicyConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    policy: str = "memory"  # "redis": limits shared by every router on one Redis (url)
    url: str | None = None  # redis://[:password@]host[:port][/db], for policy "redis"


class PriorityConfig(PolicyConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    policy: str = "fair_queue"


class BreakerConfig(PolicyConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    enabled: bool = True
    policy: str = "standard"


class RetryConfig(_Base, frozen=True, kw_only=True, forbid_unknown_fields=True):
    budget_ratio: NonNegative = 0.2  # retries in flight at most this fraction of streams in flight ...
    min_retries: Annotated[int, Meta(ge=0)] = 3  # ... or this many
    backoff_base: NonNegative = 0.025  # full-jitter backoff before a retry: up to base x 2^(k-1) ...
    backoff_cap: NonNegative = 0.25  # ... at most this


class CapacityConfig(_Base, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[capacity]``: the targets behind ``headrace_desired_replicas{model}``
    (policies/capacity.py: M/M/c on the live arrival rate and service time)."""

    p99_ms: Positive = 30000.0  # target p99 of a request's latency (arrival to last byte), ms
    models: dict[str, Positive] = {}  # per model: its own p99 target, ms
    window: Positive = 60.0  # seconds: time constant of the smoothed arrival rate
    min_replicas: Annotated[int, Meta(ge=0)] = 1
    max_replicas: PositiveInt = 1000
    max_utilisation: Annotated[float, Meta(gt=0, le=1)] = 0.9  # when no count meets the target
    # The fraction of each model's traffic one router process sees: 1 / (router pods x workers)
    # under even spreading, so each process sizes the whole fleet (average them, deploy/k8s/hpa.yaml).
    traffic_share: Annotated[float, Meta(gt=0, le=1)] = 1.0
    # The service time in the response time: "exponential" (M/M/c's own) or "fixed" (the M/M/c
    # wait plus the mean hold time: closer for fixed prompt and output lengths); headrace plan --service.
    service: Literal["exponential", "fixed"] = "exponential"
    # Act on it: every autoscale_interval seconds each [[engines]] entry is scaled to its model's
    # desired replicas (POST /admin/engines' rules: warm replicas first; router/engines.py).
    autoscale: bool = False
    autoscale_interval: Positive = 30.0


class JobsConfig(_Base, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[jobs]``: async jobs (router/jobs.py), files and batches
    (router/files.py, router/batches.py), durable in one SQLite file under
    the data directory. Off unless ``enabled``, ``data_dir`` or ``path`` is
    set (or ``--data-dir`` / ``HEADRACE_DATA_DIR``): then ``/v1/jobs`` ... are 404s."""

    enabled: bool = False  # on, in the data directory (default: $XDG_DATA_HOME/headrace or ~/.local/share/headrace)
    data_dir: str | None = None  # the data directory: headrace.db and files/ (created)
    path: str | None = None  # the SQLite database file (default: <data_dir>/headrace.db; WAL beside it)
    max_file_bytes: PositiveInt = 200 * 1024 * 1024  # an uploaded file's limit (413 past it)
    max_batch_lines: PositiveInt = 50_000  # requests in one batch's input file
    concurrency: PositiveInt = 8  # jobs running at once, all tenants
    per_tenant: PositiveInt = 2  # jobs running at once for one tenant
    max_attempts: PositiveInt = 3  # runs of a job that meets upstream errors before it fails
    retry_delay: NonNegative = 1.0  # seconds before a retry, when the error gave no Retry-After
    poll_interval: Positive = 1.0  # seconds between looks at the queue when nothing wakes the runner
    idempotency_ttl: Positive = 24 * 3600.0  # seconds an Idempotency-Key is remembered
    # A running job's runner renews its lease every lease/3 s; one silent this
    # long died (processes share the file), and its jobs are requeued.
    lease: Positive = 30.0
    # store = "postgres": the same tables in PostgreSQL at ``url`` (router/store_pg.py),
    # shared by router replicas on several hosts; needs pip install 'headrace[postgres]'.
    store: Literal["sqlite", "postgres"] = "sqlite"
    url: str | None = None  # postgresql://user@host:5432/db (a password is better in PGPASSWORD or ~/.pgpass)
    pool_size: PositiveInt = 4  # connections to PostgreSQL per router process
    store_timeout: Positive = 10.0  # seconds: connect, statement and lock timeouts (postgres)


class BackendSpec(_Base, frozen=True, kw_only=True, forbid_unknown_fields=True):
    url: str | None = None  # None: in-process (mock)
    kind: BackendKind = "openai"
    name: str | None = None  # default: derived from kind and position
    weight: Positive = 1.0
    max_concurrency: PositiveInt | None = None  # admission slots; None: [admission] backend_concurrency
    model: str | None = None  # the model name served (mocks) or asked for (HTTP backends)
    # Adapter settings: an HTTP backend's backends.openai_http.HTTPOptions
    # ({http = "1.1", api_key_env = "KEY", stall_timeout = 30, ...}), a
    # mock's backends.mock.MockConfig ({tpot_s = 0.05}).
    options: dict[str, Any] = {}
    # Cost-aware placement (policies/placement.py): cheap, interruptible capacity
    # (spot instances, a batch pool) that batch work prefers.
    preemptible: bool = False
    pool: str | None = None  # "batch": the batch pool, like preemptible


class EngineSpec(_Base, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[[engines]]``: engine replicas ``headrace serve`` runs as child processes."""

    model: str | None = None  # GGUF file or Hugging Face folder; None: the installed default model
    name: str | None = None  # replica name prefix; default: engine (the first entry), engine-<i>
    replicas: Annotated[int, Meta(ge=0)] = 1  # in rotation at startup
    warm: Annotated[int, Meta(ge=0)] = 0  # loaded and ready, out of rotation
    max_replicas: PositiveInt = 64  # the most POST /admin/engines may ask for
    args: tuple[str, ...] = ()  # more `headrace engine` flags, e.g. ["--kv-cache-gb", "2"]


class ModelVersion(_Base, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One side of a split: another configured model, and its share."""

    model: str  # a name (or alias) of another [[models]] entry
    weight: NonNegative  # relative; 0 sends it nothing (its conversations go elsewhere)


class ModelRoute(_Base, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A public model name: the group that serves it, or a split between
    versions; and what to try next when it cannot answer."""

    name: str
    aliases: tuple[str, ...] = ()
    # Backend names of the group. None: every backend that lists the upstream
    # model in its /v1/models (or lists nothing). A named group is trusted:
    # its backends get the model whether or not they list it.
    backends: tuple[str, ...] | None = None
    policy: str | None = None  # the group's routing policy; None: [routing] policy and options
    options: dict[str, Any] = {}  # that policy's factory keyword arguments
    upstream_model: str | None = None  # the model name sent to the backend; None: name
    fallbacks: tuple[str, ...] = ()  # other model names, tried in order
    # A split: each request picks one version, the same for every turn of a
    # conversation (router/routes.py). A route with versions serves nothing itself.
    versions: tuple[ModelVersion, ...] = ()
    # The model's tokenizer for cache-aware routing keys: the GGUF file or HF
    # folder its engines load (or "bytes", the mock's). None: learned from the
    # backends' /v1/models, else text blocks.
    tokenizer: str | None = None
    # This model's stream watchdog and migration limit ([migration] when unset).
    stall_timeout: Positive | None = None
    first_token_timeout: Positive | None = None
    max_migrations: Annotated[int, Meta(ge=0)] | None = None
    text_continuation: bool | None = None
    standby_tokens: Annotated[int, Meta(ge=0)] | None = None


class MigrationConfig(_Base, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Stream migration: a stream whose backend fails after its first token
    continues on another backend of its route (router/migration.py)."""

    enabled: bool = True
    max_migrations: Annotated[int, Meta(ge=0)] = 3  # per request; then the terminal error
    # Seconds without an event before a stream counts as stalled and migrates;
    # "auto": max(stall_factor x the backend's p99 inter-token latency, stall_floor),
    # stall_initial until stall_samples gaps are measured.
    stall_timeout: Positive | Literal["auto"] = "auto"
    stall_factor: Positive = 2.0
    stall_floor: Positive = 1.0
    stall_initial: Positive = 10.0
    stall_samples: PositiveInt = 64
    first_token_timeout: Positive | None = None  # None: each backend adapter's own
    replay: bool = True  # replay and verify on backends that report no token ids
    # Completions only, opt-in: where no backend has token ids and replay is off
    # or diverged, continue from prompt + the text sent (inexact, counted so).
    text_continuation: bool = False
    # Warm standby, opt-in: every this many output tokens, a stream's prompt and
    # output so far are prefilled on one other backend that holds its prompt,
    # so that a resume there recomputes at most about this many. 0: off.
    standby_tokens: Annotated[int, Meta(ge=0)] = 0


class TracingConfig(_Base, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[tracing]``: W3C traceparent is always accepted and propagated;
    spans are exported over OTLP/HTTP only with ``otlp_endpoint`` (router/tracing.py)."""

    otlp_endpoint: str | None = None  # e.g. "http://collector:4318/v1/traces"; None: no export
    sample_ratio: Annotated[float, Meta(ge=0, le=1)] = 1.0  # of new traces
    respect_parent: bool = True  # a caller's sampled flag decides for its trace
    service_name: str = "headrace-router"
    headers: dict[str, str] = {}  # sent to the collector (its auth)


class LoggingConfig(_Base, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[logging]``: ``format = "json"`` makes every log line a JSON object
    and turns on one line per request (router/logs.py)."""

    format: Literal["text", "json"] = "text"
    requests: bool | None = None  # one line per request; None: with format = "json"
    log_prompts: bool = False  # prompt and output text in request lines (off: never logged)


class RouterConfig(_Base, frozen=True, kw_only=True, forbid_unknown_fields=True):
    server: ServerConfig = ServerConfig()
    routing: RoutingConfig = RoutingConfig()
    health: HealthConfig = HealthConfig()
    auth: AuthConfig = AuthConfig()
    tenants: dict[str, TenantConfig] = {}
    admission: AdmissionConfig = AdmissionConfig()
    priority: PriorityConfig = PriorityConfig()
    ratelimit: RateLimitConfig = RateLimitConfig()
    breaker: BreakerConfig = BreakerConfig()
    retry: RetryConfig = RetryConfig()
    capacity: CapacityConfig = CapacityConfig()
    jobs: JobsConfig = JobsConfig()
    migration: MigrationConfig = MigrationConfig()
    backends: tuple[BackendSpec, ...] = ()
    engines: tuple[EngineSpec, ...] = ()
    models: tuple[ModelRoute, ...] = ()
    tracing: TracingConfig = TracingConfig()
    logging: LoggingConfig = LoggingConfig()

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
    _check_engines(config.engines, names)
    _check_models(config.models, names)
    _check_policies(config)
    _check_job_store(config.jobs)
    for i, key in enumerate(config.auth.api_keys):
        if key.tenant not in config.tenants and config.tenants:
            raise ConfigError(f"auth.api_keys[{i}].tenant: no tenant {key.tenant!r} in [tenants]")


def _check_engines(engines: tuple[EngineSpec, ...], backends: list[str]) -> None:
    """Replica names unique and apart from the backends'; counts within bounds."""
    seen: dict[str, int] = {}
    for i, spec in enumerate(engines):
        prefix = engine_name(engines, i)
        if prefix in seen:
            raise ConfigError(f"engines[{i}].name: {prefix!r} is already engines[{seen[prefix]}]'s; name each entry")
        seen[prefix] = i
        if spec.replicas + spec.warm == 0:
            raise ConfigError(f"engines[{i}]: replicas = 0 and warm = 0 start nothing; leave the entry out")
        if spec.replicas > spec.max_replicas:
            raise ConfigError(f"engines[{i}].replicas: {spec.replicas} is over max_replicas = {spec.max_replicas}")
        clash = [b for b in backends if b == prefix or b.startswith(f"{prefix}-")]
        if clash:
            raise ConfigError(f"engines[{i}].name: backend {clash[0]!r} would share its replicas' names ({prefix}-0, ...)")
        for arg in ("--host", "--port", "--model"):
            if arg in spec.args:
                raise ConfigError(f"engines[{i}].args: {arg} is set by headrace serve (the model in engines[{i}].model)")


def engine_name(engines: tuple[EngineSpec, ...], i: int) -> str:
    """``[[engines]]`` entry ``i``'s replica name prefix."""
    return engines[i].name or ("engine" if i == 0 else f"engine-{i}")


def _check_job_store(jobs: JobsConfig) -> None:
    if jobs.store == "postgres" and not jobs.url:
        raise ConfigError('jobs: store = "postgres" needs jobs.url (postgresql://user@host:5432/db)')
    if jobs.url and jobs.store != "postgres":
        raise ConfigError('jobs.url is for store = "postgres"; the SQLite store takes jobs.path')
    if jobs.url and not jobs.url.startswith(("postgresql://", "postgres://")):
        raise ConfigError(f"jobs.url must start with postgresql:// or postgres://, not {jobs.url.split('://')[0]!r}")
    if jobs.store == "postgres" and jobs.path is not None:
        raise ConfigError('jobs.path is the SQLite file; with store = "postgres" leave it out')


def _check_policies(config: RouterConfig) -> None:
    """Each section's policy resolves in its kind and takes its options."""
    sections = [("admission", config.admission.policy, config.admission.options),
                ("priority", config.priority.policy, config.priority.options),
                ("ratelimit", config.ratelimit.policy, config.ratelimit.options),
                ("breaker", config.breaker.policy, config.breaker.options)]  # fmt: skip
    for kind, name, options in sections:
        try:
            create(kind, name, options)
        except PolicyError as exc:
            raise ConfigError(f"{kind}: {exc}") from None
    shared = isinstance(create("ratelimit", config.ratelimit.policy, config.ratelimit.options), SharedRateLimitPolicy)
    url = config.ratelimit.url
    if shared and not url:
        raise ConfigError(f"ratelimit: policy {config.ratelimit.policy!r} keeps its limits in Redis: set ratelimit.url (redis://host:port/db)")
    if url and not shared:
        raise ConfigError(f"ratelimit.url is for a shared policy (policy = \"redis\"), not {config.ratelimit.policy!r}")
    if url and not url.startswith("redis://"):
        raise ConfigError(f"ratelimit.url must start with redis:// (rediss:// is not supported), not {url!r}")


def _check_models(routes: tuple[ModelRoute, ...], backends: list[str]) -> None:
    """Names unique, every reference resolves, no cycle, policies exist."""
    index: dict[str, int] = {}  # name or alias -> route index
    for i, route in enumerate(routes):
        for field, name in [("name", route.name), *(("aliases", a) for a in route.aliases)]:
            if not name:
                raise ConfigError(f"models[{i}].{field}: a model name cannot be empty")
            if name in index:
                raise ConfigError(f"models[{i}].{field}: {name!r} is already models[{index[name]}]'s name or alias")
            index[name] = i
    for i, route in enumerate(routes):
        _check_route(i, route, index, backends)
    _check_acyclic(routes, index)


def _check_route(i: int, route: ModelRoute, index: dict[str, int], backends: list[str]) -> None:
    where = f"models[{i}]"
    for name in route.fallbacks:
        if name not in index:
            raise ConfigError(f"{where}.fallbacks: unknown model {name!r} (not a [[models]] name or alias)")
    for j, version in enumerate(route.versions):
        if version.model not in index:
            raise ConfigError(f"{where}.versions[{j}].model: unknown model {version.model!r} (not a [[models]] name or alias)")
    for name in route.backends or ():
        # No [[backends]]: headrace serve starts its default ones later, and
        # the router checks the names against those (router.dispatch).
        if backends and name not in backends:
            raise ConfigError(f"{where}.backends: no backend named {name!r} (backends: {', '.join(backends)})")
    if route.backends == ():
        raise ConfigError(f"{where}.backends: an empty group serves nothing; leave it out for every backend")
    if route.options and route.policy is None:
        raise ConfigError(f"{where}.options: options go with a policy; name it in {where}.policy")
    if route.versions:
        if sum(v.weight for v in route.versions) <= 0:
            raise ConfigError(f"{where}.versions: the weights sum to 0")
        served = [f for f in ("backends", "policy", "upstream_model") if getattr(route, f) is not None]
        if served:
            raise ConfigError(f"{where}.{served[0]}: a route with versions serves nothing itself; set it on the versions")
    elif route.policy is not None:
        _check_policy(where, route.policy, route.options)


def _check_policy(where: str, name: str, options: dict[str, Any]) -> None:
    """The policy resolves (else ``.policy`` is named) and takes its options
    (else ``.options``), by building a throwaway instance: the router builds
    its own, and policies are plain objects, cheap to make."""
    try:
        load_factory(name)
    except PolicyError as exc:
        raise ConfigError(f"{where}.policy: {exc}") from None
    try:
        create_policy(name, options=options)
    except PolicyError as exc:
        raise ConfigError(f"{where}.options: {exc}") from None


def _check_acyclic(routes: tuple[ModelRoute, ...], index: dict[str, int]) -> None:
    """No route reaches itself through versions and fallbacks (depth first;
    the edge that closes the first cycle found is the field named)."""
    done: set[int] = set()

    def visit(i: int, stack: list[int]) -> None:
        if i in done:
            return
        stack.append(i)
        route = routes[i]
        for field, names in (("versions", [v.model for v in route.versions]), ("fallbacks", route.fallbacks)):
            for name in names:
                j = index[name]
                if j in stack:
                    cycle = " -> ".join(routes[k].name for k in [*stack[stack.index(j) :], j])
                    raise ConfigError(f"models[{i}].{field}: {field[:-1]} cycle {cycle}")
                visit(j, stack)
        stack.pop()
        done.add(i)

    for i in range(len(routes)):
        visit(i, [])
