"""AdaptiveK: k follows the acceptance estimate, switches off when drafting does
not pay, re-probes, and is off above the batch-size cut-off."""

from __future__ import annotations

import argparse

import pytest

from backends.engine.speculative import (
    AdaptiveK,
    SpecConfig,
    add_cli_arguments,
    best_k,
    spec_config_from_args,
)
from backends.errors import BadRequest


def test_best_k_grows_with_acceptance_and_shrinks_with_cost() -> None:
    assert best_k(0.05, 8, 0.1) == 0
    assert best_k(0.5, 8, 0.1) < best_k(0.9, 8, 0.1)
    assert best_k(1.0, 8, 0.0) == 8
    assert best_k(0.9, 8, 1.0) < best_k(0.9, 8, 0.05)


def test_low_acceptance_turns_speculation_off_then_probes() -> None:
    a = AdaptiveK(SpecConfig(num_speculative_tokens=4, probe_interval=3).adaptive_policy())
    assert a.k_for("s", 1) > 0
    for _ in range(10):
        a.observe("s", 4, 0)
    assert a.acceptance("s") < 0.05
    assert [a.k_for("s", 1) for _ in range(6)] == [0, 0, 1, 0, 0, 1]


def test_high_acceptance_uses_the_full_k() -> None:
    a = AdaptiveK(SpecConfig(num_speculative_tokens=5).adaptive_policy())
    for _ in range(10):
        a.observe("s", 5, 5)
    assert a.acceptance("s") > 0.9
    assert a.k_for("s", 1) == 5


def test_recovery_after_a_bad_patch() -> None:
    a = AdaptiveK(SpecConfig(num_speculative_tokens=4).adaptive_policy())
    for _ in range(6):
        a.observe("s", 4, 0)
    low = a.k_for("s", 1)
    for _ in range(10):
        a.observe("s", 4, 4)
    assert a.k_for("s", 1) > low


def test_large_batches_turn_speculation_off_and_non_adaptive_ignores_all() -> None:
    a = AdaptiveK(SpecConfig(max_batch_size=8, num_speculative_tokens=3).adaptive_policy())
    assert a.k_for("s", 9) == 0
    assert a.k_for("s", 8) > 0
    fixed = AdaptiveK(SpecConfig(adaptive=False, num_speculative_tokens=3).adaptive_policy())
    fixed.observe("s", 3, 0)
    assert fixed.k_for("s", 1000) == 3


def test_forget_resets_to_the_prior() -> None:
    a = AdaptiveK(SpecConfig(prior_acceptance=0.6).adaptive_policy())
    a.observe("s", 4, 0)
    a.forget("s")
    assert a.acceptance("s") == pytest.approx(0.6)


def test_cli_flags_build_a_config_and_bad_values_are_client_errors() -> None:
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    cfg = spec_config_from_args(
        parser.parse_args(["--speculative", "ngram", "--num-speculative-tokens", "6"])
    )
    assert (cfg.method, cfg.num_speculative_tokens) == ("ngram", 6)
    with pytest.raises(BadRequest):
        spec_config_from_args(parser.parse_args(["--num-speculative-tokens", "0"]))
