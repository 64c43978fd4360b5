"""The registry resolves policies by kind and name, builds them with options
from config, and names the policy, option or package at fault."""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Sequence
from typing import Annotated

import msgspec
import pytest

from policies.admission import AdmissionView, Verdict
from policies.base import BackendView, RouteRequest
from policies.registry import (
    GROUP,
    KINDS,
    PolicyError,
    available,
    create,
    create_policy,
    group,
    installed,
)
from policies.routing import LeastLoaded, RoundRobin
from router.cli import main as headrace
from router.cli import policies_main

HERE = "tests.policies.test_registry"


class Spread:
    """A routing plugin taking keyword options."""

    def __init__(self, *, spread: int = 1, salt: str = "") -> None:
        if not isinstance(spread, int):
            raise TypeError(f"spread must be an int, not {type(spread).__name__}")
        self.spread, self.salt = spread, salt

    def pick(self, candidates: Sequence[BackendView], request: RouteRequest, now: float) -> str | None:
        return candidates[0].name if candidates else None


class Structured:
    """A routing plugin declaring its options as a msgspec Struct."""

    class Options(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
        replicas: Annotated[int, msgspec.Meta(gt=0)] = 1

    def __init__(self, options: Options) -> None:
        self.options = options

    def pick(self, candidates: Sequence[BackendView], request: RouteRequest, now: float) -> str | None:
        return None


class Shed:
    """An admission plugin."""

    def __init__(self, *, limit: int = 10) -> None:
        self.limit = limit

    def decide(self, view: AdmissionView, now: float) -> Verdict:
        return Verdict(action="reject", code="shed")


class Boom:
    def __init__(self) -> None:
        raise ZeroDivisionError("no")


def ep(name: str, value: str, group: str = GROUP) -> importlib.metadata.EntryPoint:
    return importlib.metadata.EntryPoint(name, value, group)


ROUTING = group("routing")


# ------------------------------------------------------------ names


def test_builtins_are_found_by_name() -> None:
    assert available() == ["kv_aware", "least_loaded", "power_of_two", "prefix_hash", "round_robin"]
    assert isinstance(create_policy("round_robin"), RoundRobin)
    assert isinstance(create("routing", "least_loaded"), LeastLoaded)


def test_unknown_names_list_the_known_ones_plugins_included() -> None:
    with pytest.raises(PolicyError, match=r"unknown routing policy 'nope'; known: kv_aware, least_loaded, power_of_two, prefix_hash, round_robin$"):
        create_policy("nope")
    eps = [ep("spread", f"{HERE}:Spread", ROUTING)]
    with pytest.raises(PolicyError, match=r"known: kv_aware, least_loaded, power_of_two, prefix_hash, round_robin, spread$"):
        create_policy("nope", eps)
    with pytest.raises(PolicyError, match=r"unknown admission policy 'x'; known: bounded, erlang$"):
        create("admission", "x", entry_points=[])


def test_unknown_kinds_list_the_known_ones() -> None:
    with pytest.raises(PolicyError, match="unknown policy kind 'routin'; known: routing, admission, priority"):
        create("routin", "round_robin")
    assert list(KINDS) == ["routing", "admission", "priority", "ratelimit", "breaker"]


def test_each_kind_has_its_own_group_and_the_plain_group_still_means_routing() -> None:
    eps = [
        ep("old", f"{HERE}:Spread"),  # registered before kinds existed
        ep("new", f"{HERE}:Spread", ROUTING),
        ep("shed", f"{HERE}:Shed", group("admission")),
    ]
    assert available(eps) == ["kv_aware", "least_loaded", "new", "old", "power_of_two", "prefix_hash", "round_robin"]
    assert available(eps, kind="admission") == ["bounded", "erlang", "shed"]
    assert isinstance(create_policy("old", eps), Spread)
    assert isinstance(create("admission", "shed", {"limit": 3}, entry_points=eps), Shed)
    with pytest.raises(PolicyError, match="unknown routing policy 'shed'"):
        create_policy("shed", eps)


def test_failing_plugin_raises_an_error_naming_its_package() -> None:
    eps = [ep("broken", "acme_routing.missing:Policy")]
    with pytest.raises(PolicyError, match="routing policy 'broken' from package acme_routing failed to load"):
        create_policy("broken", eps)


def test_plugin_without_the_kinds_method_is_rejected() -> None:
    eps = [ep("odd", "collections:OrderedDict")]
    with pytest.raises(PolicyError, match=r"routing policy 'odd' has no pick\(candidates, request, now\) method"):
        create_policy("odd", eps)


# ------------------------------------------------------------ two claims


def test_two_packages_claiming_one_name_is_an_error_naming_both() -> None:
    eps = [ep("fast", "acme.rr:RR", ROUTING), ep("fast", "zeta.rr:RR")]
    with pytest.raises(PolicyError, match="routing policy 'fast' is registered twice: by acme and by zeta"):
        available(eps)


def test_a_plugin_claiming_a_builtin_name_is_an_error() -> None:
    with pytest.raises(PolicyError, match=r"'round_robin' is registered twice: by headrace \(built-in\) and by acme"):
        create_policy("least_loaded", [ep("round_robin", "acme.rr:RR")])


def test_one_declaration_in_both_groups_and_one_name_in_two_kinds_are_not_claims() -> None:
    eps = [
        ep("spread", f"{HERE}:Spread"),
        ep("spread", f"{HERE}:Spread", ROUTING),
        ep("spread", f"{HERE}:Shed", group("admission")),
        ep("round_robin", "policies.routing:RoundRobin", ROUTING),  # the built-in's own declaration
    ]
    assert available(eps) == ["kv_aware", "least_loaded", "power_of_two", "prefix_hash", "round_robin", "spread"]
    assert available(eps, kind="admission") == ["bounded", "erlang", "spread"]


# ------------------------------------------------------------ options


def test_options_reach_the_factory_as_keyword_arguments() -> None:
    eps = [ep("spread", f"{HERE}:Spread", ROUTING)]
    policy = create_policy("spread", eps, options={"spread": 3, "salt": "x"})
    assert isinstance(policy, Spread) and (policy.spread, policy.salt) == (3, "x")


def test_an_option_the_factory_lacks_is_named_with_the_ones_it_takes() -> None:
    eps = [ep("spread", f"{HERE}:Spread", ROUTING)]
    with pytest.raises(PolicyError, match=r"routing policy 'spread' has no option 'sprad' \(its options: spread, salt\)"):
        create_policy("spread", eps, options={"sprad": 3})
    with pytest.raises(PolicyError, match=r"routing policy 'least_loaded' has no option 'x' \(it takes no options\)"):
        create_policy("least_loaded", options={"x": 1})


def test_a_factory_raising_type_error_on_an_option_gives_a_policy_error() -> None:
    eps = [ep("spread", f"{HERE}:Spread", ROUTING)]
    with pytest.raises(PolicyError, match=r"routing policy 'spread' rejected its options \(spread\): spread must be an int"):
        create_policy("spread", eps, options={"spread": "3"})


def test_a_declared_options_struct_validates_and_names_the_bad_option() -> None:
    eps = [ep("ring", f"{HERE}:Structured", ROUTING)]
    policy = create_policy("ring", eps, options={"replicas": 4})
    assert isinstance(policy, Structured) and policy.options == Structured.Options(replicas=4)
    default = create_policy("ring", eps)
    assert isinstance(default, Structured) and default.options == Structured.Options()
    with pytest.raises(PolicyError, match="routing policy 'ring': bad option: Expected `int` >= 1 - at `replicas`"):
        create_policy("ring", eps, options={"replicas": 0})
    with pytest.raises(PolicyError, match="routing policy 'ring': bad option: Object contains unknown field `replica`"):
        create_policy("ring", eps, options={"replica": 2})


def test_a_factory_without_a_readable_signature_is_still_checked_by_the_call() -> None:
    eps = [ep("int", "builtins:int", ROUTING)]
    with pytest.raises(PolicyError, match="routing policy 'int' rejected its options"):
        create_policy("int", eps, options={"base": 2, "x": 1})


def test_a_factory_that_raises_is_named() -> None:
    with pytest.raises(PolicyError, match="routing policy 'boom' failed to initialise: ZeroDivisionError"):
        create_policy("boom", [ep("boom", f"{HERE}:Boom", ROUTING)])


# ------------------------------------------------------------ listing


PLUGINS = [
    ep("spread", f"{HERE}:Spread", ROUTING),
    ep("legacy", "acme_routing.policy:Legacy"),
    ep("shed", "acme_admission:Shed", group("admission")),
]


BUILTIN_ROWS = [
    ("kv_aware", "policies.kv_aware:KVAware"),
    ("least_loaded", "policies.routing:LeastLoaded"),
    ("power_of_two", "policies.routing:PowerOfTwo"),
    ("prefix_hash", "policies.prefix_hash:PrefixHash"),
    ("round_robin", "policies.routing:RoundRobin"),
]
OTHER_BUILTINS = [  # (kind, name, value), in KINDS order
    ("admission", "bounded", "policies.admission:BoundedQueue"),
    ("admission", "erlang", "policies.admission:ErlangShedding"),
    ("priority", "fair_queue", "policies.fairness:FairQueue"),
    ("ratelimit", "memory", "policies.ratelimit:TokenBuckets"),
    ("ratelimit", "redis", "policies.shared_limits:SharedBuckets"),
    ("breaker", "standard", "policies.breaker:Breakers"),
]


def test_installed_lists_every_kind_with_the_providing_package_and_a_summary() -> None:
    rows = installed(PLUGINS)
    assert [(r.kind, r.name, r.package, r.value, r.builtin) for r in rows] == [*sorted([("routing", n, "headrace", v, True) for n, v in BUILTIN_ROWS] + [("routing", "legacy", "acme_routing", "acme_routing.policy:Legacy", False), ("routing", "spread", "tests", f"{HERE}:Spread", False)], key=lambda r: r[1]), *[(k, n, "headrace", v, True) for k, n, v in OTHER_BUILTINS[:2]], ("admission", "shed", "acme_admission", "acme_admission:Shed", False), *[(k, n, "headrace", v, True) for k, n, v in OTHER_BUILTINS[2:]]]
    summaries = {r.name: r.summary for r in rows}
    assert summaries["prefix_hash"] == "Consistent hashing with bounded loads on the prompt's leading KV blocks."
    assert summaries["spread"] == (Spread.__doc__ or "").strip().splitlines()[0]
    assert summaries["legacy"].startswith("(fails to load: ModuleNotFoundError")  # listed, not hidden


def test_headrace_policies_prints_each_kind_and_its_policies(capsys: pytest.CaptureFixture[str]) -> None:
    assert policies_main([], PLUGINS) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "routing: picks a backend for each request [headrace.policies.routing]"
    assert "  round_robin   headrace        Smooth weighted round robin over the candidates of each call." in lines
    assert any(line.startswith("  legacy        acme_routing    (fails to load: ") for line in lines)
    admission = lines.index("admission: admits, queues or sheds a request (503 + Retry-After) [headrace.policies.admission]")
    assert lines[admission + 3] == (
        "  shed          acme_admission  (fails to load: ModuleNotFoundError(\"No module named 'acme_admission'\"))"
    )
    assert lines[-5].startswith("ratelimit: limits a tenant's request and token rates (429 + Retry-After)")
    assert lines[-4].startswith("  memory        headrace        ")
    assert lines[-3].startswith("  redis         headrace        Token buckets in Redis")
    assert lines[-2] == "breaker: opens a backend's circuit after failures [headrace.policies.breaker]"
    assert lines[-1].startswith("  standard      headrace        ")


def test_headrace_policies_lists_the_builtins_of_this_install(capsys: pytest.CaptureFixture[str]) -> None:
    assert headrace(["policies", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    builtins = [(r["kind"], r["name"], r["package"]) for r in rows if r["builtin"]]
    assert builtins == [("routing", n, "headrace") for n, _ in BUILTIN_ROWS] + [(k, n, "headrace") for k, n, _ in OTHER_BUILTINS]
    assert all(r["summary"] for r in rows if r["builtin"])


def test_headrace_policies_reports_a_double_claim_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert policies_main([], [ep("round_robin", "acme.rr:RR")]) == 1
    assert "registered twice: by headrace (built-in) and by acme" in capsys.readouterr().err
