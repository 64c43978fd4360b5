"""The verification rules as pure functions: match acceptance, padding for ragged
k, and a seeded chi-square test that rejection sampling reproduces the target."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.engine.sampling import sample
from backends.engine.sequence import SamplingParams, Sequence
from backends.engine.spec_verify import (
    ACCEPT_STREAM,
    DRAFT_STREAM,
    accept_matches,
    keyed_gumbel,
    keyed_uniforms,
    processed_logits,
    verify_deterministic,
    verify_greedy,
    verify_rejection,
)

# chi-square critical values at alpha = 0.001 (df -> value)
CHI2_CRIT = {3: 16.266, 4: 18.467}


def gumbel(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    u = torch.rand(shape, generator=gen).clamp(min=torch.finfo(torch.float32).tiny)
    return -(-u.log()).log()


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((observed - expected) ** 2 / expected).sum())


def test_match_accepts_the_leading_run_and_pads_ragged_rows() -> None:
    target = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4], [9, 9, 9, 9]])
    drafts = torch.tensor([[5, 6, 0], [1, 2, 3], [7, 7, 7]])
    num = torch.tensor([3, 2, 0])
    acc, out = accept_matches(target, drafts, num)
    assert acc.tolist() == [2, 2, 0]
    assert out.tolist() == [[5, 6, 7, -1], [1, 2, 3, -1], [9, -1, -1, -1]]


def test_a_padded_draft_never_counts_even_if_it_matches() -> None:
    target = torch.tensor([[3, 4, 5]])
    acc, out = accept_matches(target, torch.tensor([[3, 4]]), torch.tensor([1]))
    assert acc.tolist() == [1]
    assert out.tolist() == [[3, 4, -1]]


def test_all_accepted_emits_the_bonus_token() -> None:
    logits = torch.zeros(1, 3, 10)
    for i, t in enumerate([2, 7, 4]):
        logits[0, i, t] = 1.0
    acc, out = verify_greedy(logits, torch.tensor([[2, 7]]), torch.tensor([2]))
    assert acc.tolist() == [2]
    assert out.tolist() == [[2, 7, 4]]


def test_bad_shapes_are_rejected() -> None:
    with pytest.raises(ValueError):
        accept_matches(
            torch.zeros(2, 3, dtype=torch.long),
            torch.zeros(2, 3, dtype=torch.long),
            torch.tensor([1, 1]),
        )
    with pytest.raises(ValueError):
        accept_matches(
            torch.zeros(1, 3, dtype=torch.long),
            torch.zeros(1, 2, dtype=torch.long),
            torch.tensor([3]),
        )


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 5), b=st.integers(1, 4))
def test_deterministic_verification_emits_exactly_what_plain_sampling_draws(
    seed: int, k: int, b: int
) -> None:
    """Whatever is drafted, the emitted tokens are the plain-decoding picks."""
    gen = torch.Generator().manual_seed(seed)
    v = 6
    logits = torch.randn(b, k + 1, v, generator=gen)
    noise = gumbel((b, k + 1, v), gen)
    plain = (logits + noise).argmax(-1)  # [B, K+1]: what plain decoding draws per position
    # drafts: plain tokens with random corruptions
    drafts = torch.where(
        torch.rand(b, k, generator=gen) < 0.3,
        torch.randint(0, v, (b, k), generator=gen),
        plain[:, :k],
    )
    num = torch.randint(0, k + 1, (b,), generator=gen)
    acc, out = verify_deterministic(logits, drafts, num, noise)
    for i in range(b):
        a = int(acc[i])
        assert a <= int(num[i])
        assert out[i, : a + 1].tolist() == plain[i, : a + 1].tolist()
        assert (out[i, a + 1 :] == -1).all()
        if a < int(num[i]):
            assert int(drafts[i, a]) != int(plain[i, a])


P = torch.tensor([0.05, 0.40, 0.25, 0.20, 0.10])
Q = torch.tensor([0.30, 0.10, 0.30, 0.05, 0.25])
P1 = torch.tensor([0.50, 0.05, 0.15, 0.10, 0.20])
Q1 = torch.tensor([0.20, 0.20, 0.20, 0.20, 0.20])


def _run_rejection(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p = torch.stack([P, P1, P]).expand(n, 3, 5)  # [B, K+1, V]
    q = torch.stack([Q, Q1]).expand(n, 2, 5)  # [B, K, V]
    drafts = torch.stack(
        [
            torch.multinomial(Q, n, replacement=True, generator=gen),
            torch.multinomial(Q1, n, replacement=True, generator=gen),
        ],
        dim=1,
    )
    uniforms = torch.rand(n, 2, generator=gen)
    acc, out = verify_rejection(p, q, drafts, torch.full((n,), 2), uniforms, gumbel((n, 3, 5), gen))
    return acc, out, drafts


def test_rejection_sampling_reproduces_the_target_distribution() -> None:
    """Seeded chi-square at alpha=0.001 on hand-made p, q: the first emitted token
    is distributed as p_0, the second (given the first was accepted) as p_1."""
    n = 40_000
    acc, out, drafts = _run_rejection(n, seed=1234)
    assert chi_square(out[:, 0], P) < CHI2_CRIT[4]
    second = out[acc >= 1, 1]
    assert second.numel() > 10_000
    assert chi_square(second, P1) < CHI2_CRIT[4]
    # negative control: the drafts themselves are far from p
    assert chi_square(drafts[:, 0], P) > 100 * CHI2_CRIT[4]
    # acceptance of the first draft ~ sum(min(p, q))
    alpha = float(torch.minimum(P, Q).sum())
    assert abs(float((acc >= 1).double().mean()) - alpha) < 0.01


def test_rejection_with_equal_distributions_accepts_everything() -> None:
    gen = torch.Generator().manual_seed(0)
    n = 200
    p = P.expand(n, 2, 5)
    drafts = torch.multinomial(P, n, replacement=True, generator=gen).unsqueeze(1)
    acc, out = verify_rejection(
        p,
        p[:, :1],
        drafts,
        torch.ones(n, dtype=torch.long),
        torch.rand(n, 1, generator=gen),
        gumbel((n, 2, 5), gen),
    )
    assert acc.tolist() == [1] * n
    assert (out[:, 0] == drafts[:, 0]).all()


def test_rejection_never_emits_a_token_the_target_rules_out() -> None:
    gen = torch.Generator().manual_seed(7)
    n = 2000
    p = torch.tensor([0.0, 0.5, 0.5, 0.0]).expand(n, 2, 4)
    q = torch.tensor([0.7, 0.1, 0.1, 0.1]).expand(n, 1, 4)
    drafts = torch.multinomial(q[0, 0], n, replacement=True, generator=gen).unsqueeze(1)
    acc, out = verify_rejection(
        p,
        q,
        drafts,
        torch.ones(n, dtype=torch.long),
        torch.rand(n, 1, generator=gen),
        gumbel((n, 2, 4), gen),
    )
    emitted = out[out >= 0]
    assert set(emitted.tolist()) <= {1, 2}
    assert int(acc.sum()) > 0


def test_processed_logits_plus_keyed_noise_is_the_samplers_draw() -> None:
    """The verifier's view of a row reproduces sample() exactly: same penalties,
    same masks, same (seed, position) noise."""
    gen = torch.Generator().manual_seed(3)
    seqs = [
        Sequence("a", [1, 2, 3, 2], SamplingParams(temperature=0.7, top_k=5, seed=11)),
        Sequence(
            "b",
            [4, 4, 5],
            SamplingParams(
                temperature=1.3, top_p=0.8, repetition_penalty=1.5, seed=12, min_tokens=3
            ),
        ),
    ]
    seqs[1].num_prompt_tokens = 1
    raw = torch.randn(2, 16, generator=gen)
    positions = [9, 4]
    y = processed_logits(raw, seqs, [7], positions)
    keys = [(s.params.seed or 0, p) for s, p in zip(seqs, positions, strict=True)]
    mine = (y + keyed_gumbel(keys, 16)).argmax(-1).tolist()
    assert mine == [t for t, _ in sample(raw, seqs, [7], positions)]
    assert y[1, 7] == float("-inf")  # min_tokens masks EOS


def test_keyed_randomness_is_a_pure_function_of_seed_and_position() -> None:
    a = keyed_uniforms([(1, 5), (1, 6), (2, 5)], ACCEPT_STREAM)
    b = keyed_uniforms([(2, 5), (1, 5)], ACCEPT_STREAM)
    assert a[2] == b[0] and a[0] == b[1]
    assert len({float(x) for x in a}) == 3
    assert not torch.equal(keyed_gumbel([(1, 5)], 8, DRAFT_STREAM), keyed_gumbel([(1, 5)], 8))
