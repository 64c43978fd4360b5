"""The TOML config decodes into frozen Structs; mistakes exit 2 with one clear line."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from policies.registry import PolicyError
from router.app import Router
from router.config import (
    BackendSpec,
    ConfigError,
    RouterConfig,
    load_config,
    with_overrides,
)
from router.factory import build_backends, default_backends
from router.server import main


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "headrace.toml"
    path.write_text(text)
    return str(path)


def test_full_config_round_trips(tmp_path: Path) -> None:
    config = load_config(
        write(
            tmp_path,
            """
[server]
port = 0
drain_timeout = 5
[routing]
policy = "least_loaded"
[auth]
keys = { "sk-a" = "team-a" }
[[backends]]
url = "http://127.0.0.1:9000"
name = "gpu-a"
weight = 2
[[backends]]
kind = "mock"
""",
        )
    )
    assert config.server.port == 0 and config.server.drain_timeout == 5.0
    assert config.routing.policy == "least_loaded"
    assert config.auth.keys == {"sk-a": "team-a"}
    assert config.backend_names() == ["gpu-a", "mock-1"]
    assert config.backends[0] == BackendSpec(url="http://127.0.0.1:9000", name="gpu-a", weight=2.0)


def test_no_file_means_defaults_and_the_default_backends_are_engine_replicas() -> None:
    config = load_config(None)
    assert config == RouterConfig()
    assert build_backends(config) == []  # the server starts local engines instead
    specs = default_backends(["http://127.0.0.1:1", "http://127.0.0.1:2"])
    assert [(s.kind, s.name, s.url) for s in specs] == [
        ("engine", "engine-0", "http://127.0.0.1:1"),
        ("engine", "engine-1", "http://127.0.0.1:2"),
    ]
    backends = build_backends(with_overrides(config, backends=specs))
    assert [b.name for b in backends] == ["engine-0", "engine-1"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[server]\nprot = 1", "unknown field `prot`"),
        ("[server]\nport = 70000", "$.server.port"),
        ("[routing]\nmax_attempts = 0", "$.routing.max_attempts"),
        ("[[backends]]\nurl = 'http://a'\nweight = -1", "$.backends[0].weight"),
        ("[[backends]]\nkind = 'openai'", "needs a url"),
        ("[[backends]]\nkind = 'grpc'\nurl = 'http://a'", "$.backends[0].kind"),
        ("[[backends]]\nurl = 'ftp://a'", "must start with http"),
        ("[[backends]]\nurl = 'http://a'\nname='x'\n[[backends]]\nurl = 'http://b'\nname='x'", "repeated: x"),
        ("[server]\ncertfile = 'c.pem'", "go together"),
        ("port = [", "not valid TOML"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert message in str(info.value)


def test_command_line_overrides_fields() -> None:
    config = with_overrides(RouterConfig(), port=0, policy="least_loaded", host=None)
    assert (config.server.port, config.routing.policy, config.server.host) == (0, "least_loaded", "127.0.0.1")
    with pytest.raises(ConfigError, match="no configuration field named 'nope'"):
        with_overrides(RouterConfig(), nope=1)


def test_routing_options_table_reaches_the_policy_factory(tmp_path: Path) -> None:
    """[routing.options] is passed to the factory; one it rejects is named."""
    config = load_config(write(tmp_path, '[routing]\npolicy = "least_loaded"\n[routing.options]\nspread = 2\n'))
    assert config.routing.options == {"spread": 2}
    assert RouterConfig().routing.options == {}
    with pytest.raises(PolicyError, match="routing policy 'least_loaded' has no option 'spread'"):
        Router(config, [])


def test_config_is_frozen() -> None:
    with pytest.raises(AttributeError):
        RouterConfig().server.port = 1  # type: ignore[misc]
    assert msgspec.to_builtins(RouterConfig())["server"]["drain_timeout"] == 30.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "-1"], "server.port"),
        (["--policy", "fastest"], "unknown routing policy 'fastest'"),
        (["--config", "/nonexistent.toml"], "cannot read config"),
        (["--backend", "localhost:9"], "must start with http"),
    ],
)
def test_serve_exits_2_on_bad_config(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("headrace serve: ") and message in err


@pytest.mark.parametrize("held", ["main", "admin"])
def test_serve_with_one_worker_exits_1_in_a_line_when_a_port_is_taken(
    held: str, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """As the supervisor of several workers does: the port in use (the main
    listener's, or the admin one's, the main + 1) named, no traceback."""
    with socket.socket() as probe:  # a free pair: port, port + 1
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1] - 1
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port + (held == "admin")))
        holder.listen()
        status = main(["--workers", "1", "--port", str(port), "--backend", "http://127.0.0.1:9", "--log-level", "WARNING"])
    err = capsys.readouterr().err
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert status == 1 and "Traceback" not in err, err
    assert len(errors) == 1 and errors[0].startswith("headrace serve: ") and not caplog.records[-1].exc_info, errors
    assert "Address already in use" in errors[0] and f"127.0.0.1:{port + 1}: [server] admin_port" in errors[0], errors


def test_serve_mock_options_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "[[backends]]\nkind = 'mock'\noptions = { tpot = 1 }")
    assert main(["--config", path]) == 2
    assert "unknown mock options: tpot" in capsys.readouterr().err


def test_the_readme_configuration_example_is_valid(tmp_path: Path) -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    start = readme.index("```toml\n") + len("```toml\n")
    example = tmp_path / "example.toml"
    example.write_text(readme[start : readme.index("```", start)])
    config = load_config(example)
    assert [b.kind for b in config.backends] == ["openai", "mock"]
    assert config.auth.keys["sk-team-a"] == "team-a"


def test_set_reaches_every_field_by_dotted_path() -> None:
    from router.config import RouterConfig, apply_settings, decode_config

    base = decode_config({"backends": [{"url": "http://127.0.0.1:9", "name": "a"}]})
    config = apply_settings(base, [
        "routing.max_attempts=5",
        "server.host=0.0.0.0",  # not TOML: read as a string
        'server.port=9001',
        'auth.keys={ "sk-1" = "team-a" }',
        'backends.0.options.http="1.1"',
        "backends.0.weight=2.5",
    ])  # fmt: skip
    assert config.routing.max_attempts == 5 and config.server.host == "0.0.0.0"
    assert config.server.port == 9001 and config.auth.keys == {"sk-1": "team-a"}
    assert config.backends[0].options == {"http": "1.1"} and config.backends[0].weight == 2.5
    assert apply_settings(RouterConfig(), []) == RouterConfig()


@pytest.mark.parametrize(
    "setting,said",
    [
        ("routing.max_attempts=0", "max_attempts"),
        ("routing.nope=1", "nope"),
        ("nosection.x=1", "nosection"),
        ("backends.3.weight=1", "no list entry"),
        ("justtext", "expected section.field=value"),
        ("server.port.x=1", "inside a value"),
    ],
)
def test_a_bad_set_says_which_field(setting: str, said: str) -> None:
    from router.config import apply_settings, decode_config

    base = decode_config({"backends": [{"url": "http://127.0.0.1:9"}]})
    with pytest.raises(ConfigError, match=said):
        apply_settings(base, [setting])


def test_serve_set_on_the_command_line(tmp_path: Path) -> None:
    from router.server import config_from_args, parse_args

    config = config_from_args(parse_args(["--backend", "http://127.0.0.1:9", "--set", "health.interval=0.5"]))
    assert config.health.interval == 0.5


BACKENDS = "[[backends]]\nkind = 'mock'\nname = 'a'\n[[backends]]\nkind = 'mock'\nname = 'b'\n"


def test_model_routes_decode_with_their_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, BACKENDS + """
[[models]]
name = "chat"
aliases = ["gpt-4o"]
backends = ["a"]
policy = "least_loaded"
upstream_model = "llama"
fallbacks = ["small"]
[[models]]
name = "small"
[[models]]
name = "assistant"
versions = [{ model = "chat", weight = 95 }, { model = "gpt-4o", weight = 5 }]
"""))  # fmt: skip
    chat, small, assistant = config.models
    assert (chat.backends, chat.policy, chat.upstream_model, chat.fallbacks) == (("a",), "least_loaded", "llama", ("small",))
    assert (small.backends, small.policy, small.upstream_model, small.versions) == (None, None, None, ())
    assert [(v.model, v.weight) for v in assistant.versions] == [("chat", 95.0), ("gpt-4o", 5.0)]


@pytest.mark.parametrize(
    ("models", "message"),
    [
        ("[[models]]\nname = 'x'\npolicy = 'fastest'", "models[0].policy: unknown routing policy 'fastest'"),
        ("[[models]]\nname = 'x'\npolicy = 'round_robin'\noptions = { spread = 2 }", "models[0].options: routing policy 'round_robin' has no option 'spread'"),
        ("[[models]]\nname = 'x'\noptions = { spread = 2 }", "models[0].options: options go with a policy"),
        ("[[models]]\nname = 'x'\nbackends = ['a', 'gpu-z']", "models[0].backends: no backend named 'gpu-z'"),
        ("[[models]]\nname = 'x'\nbackends = []", "models[0].backends: an empty group"),
        ("[[models]]\nname = 'x'\nfallbacks = ['y']", "models[0].fallbacks: unknown model 'y'"),
        ("[[models]]\nname = 'x'\nfallbacks = ['x']", "models[0].fallbacks: fallback cycle x -> x"),
        ("[[models]]\nname = 'x'\nfallbacks = ['y']\n[[models]]\nname = 'y'\nfallbacks = ['z']\n[[models]]\nname = 'z'\nfallbacks = ['x']",
         "models[2].fallbacks: fallback cycle x -> y -> z -> x"),
        ("[[models]]\nname = 'x'\nversions = [{ model = 'y', weight = 1 }]\n[[models]]\nname = 'y'\nfallbacks = ['x']",
         "models[1].fallbacks: fallback cycle x -> y -> x"),
        ("[[models]]\nname = 'x'\nversions = [{ model = 'v9', weight = 1 }]", "models[0].versions[0].model: unknown model 'v9'"),
        ("[[models]]\nname = 'x'\nversions = [{ model = 'y', weight = 0 }]\n[[models]]\nname = 'y'", "models[0].versions: the weights sum to 0"),
        ("[[models]]\nname = 'x'\nversions = [{ model = 'y', weight = -1 }]\n[[models]]\nname = 'y'", "$.models[0].versions[0].weight"),
        ("[[models]]\nname = 'x'\nbackends = ['a']\nversions = [{ model = 'y', weight = 1 }]\n[[models]]\nname = 'y'",
         "models[0].backends: a route with versions serves nothing itself"),
        ("[[models]]\nname = 'x'\n[[models]]\nname = 'y'\naliases = ['x']", "models[1].aliases: 'x' is already models[0]'s name"),
        ("[[models]]\nname = 'x'\nweight = 2", "unknown field `weight`"),
    ],
)
def test_a_bad_model_route_is_a_config_error_naming_the_field(tmp_path: Path, models: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, BACKENDS + models))
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("models", "field"),
    [
        ("[[models]]\nname = 'x'\npolicy = 'fastest'", "models[0].policy"),
        ("[[models]]\nname = 'x'\nfallbacks = ['x']", "models[0].fallbacks"),
        ("[[models]]\nname = 'x'\nbackends = ['gpu-z']", "models[0].backends"),
        ("[[models]]\nname = 'x'\nfallbacks = ['nope']", "models[0].fallbacks"),
    ],
)
def test_serve_exits_2_with_one_line_on_a_bad_model_route(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], models: str, field: str
) -> None:
    assert main(["--config", write(tmp_path, BACKENDS + models)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("headrace serve: ") and field in err and err.count("\n") == 1, err


@pytest.fixture
def collector_settings() -> Iterator[None]:
    """The collector as it was, after a test that freezes and tunes it."""
    import gc

    thresholds = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def test_serving_starts_with_the_startup_heap_frozen_out_of_the_collectors_reach(collector_settings: None) -> None:
    """What is alive once serving starts is frozen (gc.freeze), so a full
    collection under load walks only what requests made since."""
    import gc
    import weakref

    from router.server import freeze_startup_heap

    class Cycle:
        def __init__(self) -> None:
            self.me = self

    garbage, alive = Cycle(), Cycle()
    dead = weakref.ref(garbage)
    del garbage
    freeze_startup_heap()
    assert dead() is None and gc.get_freeze_count() > 1000  # the garbage collected first
    assert not any(o is alive for o in gc.get_objects())  # the live one frozen, out of the collector's reach
    gc.unfreeze()
    assert any(o is alive for o in gc.get_objects())


CPYTHON_GC_THRESHOLDS = (700, 10, 10)


def _dead_cycles_waiting(requests: int = 200_000, in_flight: int = 2_000) -> int:
    """The most dead reference cycles waiting for the collector at once
    while "requests" live for a while and die, as a router's in flight do:
    each is a cycle (as trio's frames, tasks and exceptions make) that
    outlives the young collections, so once dead only a collection of the
    generation it was promoted to frees it."""
    import weakref
    from collections import deque

    class Request:
        def __init__(self) -> None:
            self.me = self
            self.parts = [self, {}, [1, 2]]

    freed = 0

    def gone(_: object) -> None:
        nonlocal freed
        freed += 1

    refs, alive, worst = set(), deque[Request](), 0
    for made in range(1, requests + 1):
        request = Request()
        ref = weakref.ref(request, gone)
        refs.add(ref)
        alive.append(request)
        if len(alive) > in_flight:
            alive.popleft()
        del request
        worst = max(worst, made - freed - len(alive))
    return worst


def test_serving_frees_dead_request_cycles_as_cpythons_collector_does(collector_settings: None) -> None:
    """The serving collector must not let requests' dead cycles pile up: with
    the oldest generation's threshold at 300 (tried for refusal latency) they
    reached ~10x CPython's here (every request a cycle, 2,000 in flight),
    and the router's RSS grew 71% in ``bench chaos``. The serving young
    threshold (10,000) lets dead cycles wait longer, boundedly: ~1.9x
    CPython's in this worst case, as many as CPython's with 200 in flight.
    Compared with CPython's thresholds in this process."""
    import gc

    from router.server import freeze_startup_heap

    def waiting(thresholds: tuple[int, int, int] | None) -> int:
        if thresholds is None:
            freeze_startup_heap()  # whatever the router sets while serving
        else:
            gc.set_threshold(*thresholds)
            gc.collect()
            gc.freeze()
        # The steady state: the first full collection after a freeze waits for
        # the oldest generation to pass a quarter of the heap frozen (the last
        # full collection's count); one now, on an empty oldest generation,
        # makes the measure independent of what this process holds.
        gc.collect()
        try:
            return _dead_cycles_waiting()
        finally:
            gc.unfreeze()

    gc.set_threshold(*CPYTHON_GC_THRESHOLDS)
    cpython, serving, tuned = waiting(CPYTHON_GC_THRESHOLDS), waiting(None), waiting((700, 3, 300))
    assert serving <= 2.5 * cpython, (serving, cpython)
    assert tuned > 5 * cpython, (tuned, cpython)  # the measure sees a pile-up


def test_serving_collects_the_young_generation_after_10000_allocations(collector_settings: None) -> None:
    """Requests in flight hold thousands of young objects: at CPython's 700
    the collector walked them every few requests (5.8% of the router's CPU
    under load). A burst of 5,000 live objects triggers no collection while
    serving, and one with CPython's thresholds."""
    import gc

    from router.server import SERVING_GC_THRESHOLDS, freeze_startup_heap

    def collections_during_a_burst() -> int:
        runs = []
        gc.callbacks.append(lambda phase, info: runs.append(info["generation"]) if phase == "start" else None)
        try:
            burst = [[i] for i in range(5_000)]  # tracked containers, alive together
            del burst
        finally:
            gc.callbacks.pop()
        return len(runs)

    freeze_startup_heap()
    assert gc.get_threshold() == SERVING_GC_THRESHOLDS and SERVING_GC_THRESHOLDS[1:] == CPYTHON_GC_THRESHOLDS[1:]
    gc.collect()  # the count from zero
    assert collections_during_a_burst() == 0
    gc.set_threshold(*CPYTHON_GC_THRESHOLDS)
    gc.collect()
    assert collections_during_a_burst() >= 1
