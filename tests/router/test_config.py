"""The TOML config decodes into frozen Structs; mistakes exit 2 with one clear line."""

from __future__ import annotations

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
