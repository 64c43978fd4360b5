"""Sampling: exact masks, greedy, penalties, position-keyed seeded noise."""

from __future__ import annotations

import math

import torch

from backends.engine.sampling import apply_sampling_masks, noise_seed, sample
from backends.engine.sequence import SamplingParams, Sequence


def seq(prompt: list[int], *, out: list[int] = (), **kw) -> Sequence:
    s = Sequence("s", prompt, SamplingParams(**{"seed": 1, **kw}))
    s.token_ids.extend(out)
    return s


def kept(y: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(y[0])).flatten().tolist())


LOGITS = torch.log(torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]]))  # probs sum to 1


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    seqs = [seq([1, 2], temperature=0.0, seed=i) for i in range(6)]
    assert [t for t, _ in sample(logits, seqs)] == logits.argmax(-1).tolist()


def test_top_k_keeps_exactly_the_k_most_likely() -> None:
    y = apply_sampling_masks(LOGITS, [SamplingParams(top_k=2)])
    assert kept(y) == {1, 3}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    cases = {
        0.4: {1},
        0.41: {1, 3},
        0.7: {1, 3},
        0.71: {1, 3, 4},
        0.95: {1, 3, 4, 2},
        1.0: {0, 1, 2, 3, 4},
    }
    for p, expected in cases.items():
        assert kept(apply_sampling_masks(LOGITS, [SamplingParams(top_p=p)])) == expected, p


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    # best prob 0.4: min_p 0.3 -> threshold 0.12 keeps 0.4, 0.3, 0.15
    assert kept(apply_sampling_masks(LOGITS, [SamplingParams(min_p=0.3)])) == {1, 3, 4}


def test_masks_compose_per_row() -> None:
    x = LOGITS.repeat(3, 1)
    params = [SamplingParams(top_k=1), SamplingParams(top_p=0.71), SamplingParams()]
    y = apply_sampling_masks(x, params)
    assert [kept(y[i : i + 1]) for i in range(3)] == [{1}, {1, 3, 4}, {0, 1, 2, 3, 4}]


def test_same_seed_and_position_give_the_same_token_whatever_the_batch() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 100, generator=g)
    seqs = [seq(list(range(i + 1)), seed=100 + i, temperature=1.3, top_p=0.9) for i in range(8)]
    alone = [sample(logits[i : i + 1], [seqs[i]])[0][0] for i in range(8)]
    batched = [t for t, _ in sample(logits, seqs)]
    perm = [5, 2, 7, 0, 1, 6, 3, 4]
    permuted = [t for t, _ in sample(logits[perm], [seqs[i] for i in perm])]
    assert batched == alone
    assert permuted == [alone[i] for i in perm]
    # With a padding row of noise in between, still the same.
    extra = seq([9], seed=7)
    mixed = sample(
        torch.cat([logits[:1], torch.randn(1, 100), logits[1:2]]), [seqs[0], extra, seqs[1]]
    )
    assert [mixed[0][0], mixed[2][0]] == alone[:2]


def test_noise_depends_on_seed_and_position() -> None:
    keys = {noise_seed(s, p) for s in range(20) for p in range(20)}
    assert len(keys) == 400 and all(0 <= k < 2**63 for k in keys)
    logits = torch.zeros(1, 1000)  # uniform: the draw is the noise's argmax
    draws = {sample(logits, [seq([1] * p, seed=5)])[0][0] for p in range(1, 30)}
    assert len(draws) > 20  # different positions draw differently


def test_temperature_sampling_follows_softmax() -> None:
    """Seeded chi-square over many seeds on a hand-made distribution."""
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    temp = 2.0
    logits = (probs.log() * temp).unsqueeze(0)  # softmax(logits / T) == probs
    n = 4000
    seqs = [seq([1], seed=s, temperature=temp) for s in range(n)]
    tokens = [t for t, _ in sample(logits.repeat(n, 1), seqs)]
    counts = torch.bincount(torch.tensor(tokens), minlength=5).double()
    expected = probs.double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.47  # df=4, p=0.001


def test_repetition_presence_and_frequency_penalties() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0, 0.5]])
    s = seq([0, 1], out=[2, 2], temperature=0.0, repetition_penalty=2.0)
    # token 0 (prompt): 2.0 / 2 = 1.0; token 1: -2 * 2 = -4; token 2 (output): 0.5; 3 untouched: 1.0
    x = logits.clone()
    from backends.engine.sampling import apply_penalties

    apply_penalties(x, [s], [len(s.token_ids)])
    assert x.tolist() == [[1.0, -4.0, 0.5, 1.0, 0.5]]
    s2 = seq([0, 1], out=[2, 2, 3], temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25)
    x = logits.clone()
    apply_penalties(x, [s2], [len(s2.token_ids)])
    # prompt tokens untouched; 2: 1 - 0.5 - 2*0.25 = 0; 3: 1 - 0.5 - 0.25 = 0.25
    assert x.tolist() == [[2.0, -2.0, 0.0, 0.25, 0.5]]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])  # 1 = EOS, 2 = a stop id
    s = seq([3], out=[3], temperature=0.0, min_tokens=2, stop_token_ids=(2,))
    assert sample(logits, [s], eos_token_ids=(1,))[0][0] == 3
    s.token_ids.append(3)  # two outputs now: EOS allowed again
    assert sample(logits, [s], eos_token_ids=(1,))[0][0] == 1
    ign = seq([3], temperature=0.0, min_tokens=2, ignore_eos=True)
    assert sample(logits, [ign], eos_token_ids=(1,))[0][0] == 1  # EOS is not a stop here


def test_logprobs_report_the_chosen_token_and_top_alternatives() -> None:
    logits = LOGITS.clone()
    (tok, lp), (_, lp2) = sample(
        logits.repeat(2, 1), [seq([1], temperature=0.0, logprobs=2), seq([1], temperature=0.0)]
    )
    assert tok == 1 and lp2 is None
    assert lp.token_id == 1 and math.isclose(lp.logprob, math.log(0.4), rel_tol=1e-5)
    assert [t.token_id for t in lp.top] == [1, 3]
    assert math.isclose(lp.top[1].logprob, math.log(0.3), rel_tol=1e-5)


def test_sampled_token_is_never_masked_out() -> None:
    logits = torch.randn(64, 30, generator=torch.Generator().manual_seed(9))
    seqs = [seq([1], seed=s, top_k=3, top_p=0.8, min_p=0.1, temperature=0.7) for s in range(64)]
    masked = apply_sampling_masks(logits, [s.params for s in seqs])
    for i, (tok, _) in enumerate(sample(logits, seqs)):
        assert torch.isfinite(masked[i, tok])


def reference_top_p(row: torch.Tensor, p: float) -> set[int]:
    probs = row.softmax(-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep, mass = set(), 0.0
    for i in order:
        if mass >= p:
            break
        keep.add(i)
        mass += probs[i]
    return keep


def test_top_p_is_exact_for_wide_nuclei_and_mixed_rows() -> None:
    """Flat rows need more than the first candidate window; peaked ones do not."""
    g = torch.Generator().manual_seed(4)
    x = torch.cat([torch.randn(2, 3000, generator=g) * 0.3, torch.randn(2, 3000, generator=g) * 6])
    ps = [0.9, 1.0, 0.5, 0.95]
    y = apply_sampling_masks(x, [SamplingParams(top_p=p) for p in ps])
    for i, p in enumerate(ps):
        expected = set(range(3000)) if p == 1.0 else reference_top_p(x[i], p)
        assert kept(y[i : i + 1]) == expected
    assert len(kept(y[0:1])) > 256  # the widening path ran
