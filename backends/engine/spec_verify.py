"""Speculative verification as pure tensor functions: drafts and target scores in,
(number accepted, tokens emitted) out. No model, no sequence, no state.

Every function is batched over ``B`` requests that each proposed a different number
of drafts ``n_b <= K`` (per-request k, possibly 0): drafts are padded to ``[B, K]``
and the target gives ``K + 1`` positions per request (the ``n_b`` drafts plus the
bonus position after them); ``num_drafts`` says which entries are real. Outputs are
padded with ``-1`` (vLLM's convention)::

    drafts   d_0 d_1 d_2 -1          num_drafts = 3, K = 4
    target   t_0 t_1 t_2 t_3 .       t_i: the target's choice at draft position i
    accept   d_0 == t_0, d_1 == t_1, d_2 != t_2          -> num_accepted = 2
    output   t_0 t_1 t_2 -1 -1       always num_accepted + 1 tokens

Two rules (engines.md §2):

* **Match** (deterministic proposals: n-gram, greedy or noise-coupled draft): the
  target picks its token at each position exactly as plain decoding would (argmax for
  greedy; argmax of processed logits + the sampler's Gumbel noise keyed by (seed,
  position) for sampled requests) and drafts are accepted while they agree. The
  emitted tokens are then *identical* to non-speculative decoding, whatever was
  proposed (§2.3).
* **Rejection** (proposals sampled from a draft distribution ``q``, Leviathan/Chen):
  accept ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first
  rejection emit a draw from ``normalize(max(p - q, 0))``; if all are accepted emit a
  draw from ``p`` at the bonus position. The output is distributed exactly as ``p``.
  The uniforms and the Gumbel noise come in as arguments, so callers key them by
  (seed, position) and tests fix them.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

# The sampler's own noise and processing, so verification sees exactly what plain
# decoding sees. _apply_penalties/_mask_min_tokens are private there; see report.
from backends.engine.sampling import (
    _apply_penalties,
    _mask_min_tokens,
    apply_sampling_masks,
    gumbel_noise,
    noise_seed,
)
from backends.engine.sequence import Sequence

__all__ = [
    "ACCEPT_STREAM",
    "DRAFT_STREAM",
    "accept_matches",
    "keyed_gumbel",
    "keyed_uniforms",
    "processed_logits",
    "verify_deterministic",
    "verify_greedy",
    "verify_rejection",
]


def _draft_mask(num_drafts: torch.Tensor, k: int) -> torch.Tensor:
    """[B] counts -> [B, K] bool, True where a draft is real."""
    return torch.arange(k, device=num_drafts.device).unsqueeze(0) < num_drafts.unsqueeze(1)


def _emit(prefix: torch.Tensor, num_accepted: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Output rows ``prefix[:a] + [last]`` padded with -1.
    prefix: [B, K+1] long; num_accepted, last: [B] -> [B, K+1]."""
    k1 = prefix.shape[1]
    idx = torch.arange(k1, device=prefix.device).unsqueeze(0)  # [1, K+1]
    a = num_accepted.unsqueeze(1)  # [B, 1]
    out = torch.where(idx < a, prefix, torch.full_like(prefix, -1))
    return torch.where(idx == a, last.unsqueeze(1), out)


def _check(draft_tokens: torch.Tensor, num_drafts: torch.Tensor, positions: int) -> None:
    if draft_tokens.dim() != 2 or num_drafts.dim() != 1:
        raise ValueError("draft_tokens must be [B, K] and num_drafts [B]")
    b, k = draft_tokens.shape
    if num_drafts.shape[0] != b or positions != k + 1:
        raise ValueError(f"expected {b} requests with {k + 1} target positions, got {positions}")
    if bool(((num_drafts < 0) | (num_drafts > k)).any()):
        raise ValueError(f"num_drafts must be in [0, {k}]")


def accept_matches(
    target_tokens: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The match rule on already-chosen target tokens.

    target_tokens: [B, K+1] long (the target's pick at each position);
    draft_tokens: [B, K] long (padding: anything); num_drafts: [B] long.
    Returns (num_accepted [B] long, output [B, K+1] long padded with -1)."""
    _check(draft_tokens, num_drafts, target_tokens.shape[1])
    k = draft_tokens.shape[1]
    agree = (target_tokens[:, :k] == draft_tokens) & _draft_mask(num_drafts, k)  # [B, K]
    num_accepted = agree.long().cumprod(dim=1).sum(dim=1)  # [B]: leading run of agreements
    last = target_tokens.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [B]
    return num_accepted, _emit(target_tokens, num_accepted, last)


def verify_greedy(
    target_logits: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept while the target's argmax agrees. target_logits: [B, K+1, V]."""
    return accept_matches(target_logits.argmax(dim=-1), draft_tokens, num_drafts)


def verify_deterministic(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    gumbel: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample-and-match for deterministic proposals of sampled requests.

    target_logits: [B, K+1, V], already processed as the sampler does (penalties,
    temperature, top-k/p, min-p as -inf); gumbel: [B, K+1, V], the sampler's noise
    for (seed, position) of each slot. The target's pick is
    ``argmax(logits + gumbel)``: exactly the token plain decoding draws there."""
    if gumbel.shape != target_logits.shape:
        raise ValueError("gumbel noise must have the shape of target_logits")
    return accept_matches((target_logits + gumbel).argmax(dim=-1), draft_tokens, num_drafts)


def verify_rejection(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    uniforms: torch.Tensor,
    gumbel: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan/Chen modified rejection sampling.

    target_probs p: [B, K+1, V]; draft_probs q: [B, K, V] (the distributions the
    drafts were drawn from); draft_tokens: [B, K]; num_drafts: [B];
    uniforms: [B, K] in [0, 1) (acceptance draws); gumbel: [B, K+1, V] (noise
    for the residual / bonus draw at each position).
    Returns (num_accepted [B], output [B, K+1] padded with -1)."""
    _check(draft_tokens, num_drafts, target_probs.shape[1])
    b, k = draft_tokens.shape
    if draft_probs.shape[:2] != (b, k) or uniforms.shape != (b, k):
        raise ValueError("draft_probs must be [B, K, V] and uniforms [B, K]")
    x = draft_tokens.clamp(min=0).unsqueeze(2)  # [B, K, 1]
    p_x = target_probs[:, :k].gather(2, x).squeeze(2)  # [B, K]
    q_x = draft_probs.gather(2, x).squeeze(2)  # [B, K]
    # u <= p/q without dividing (q_x > 0 for a token drawn from q)
    accept = (uniforms * q_x <= p_x) & _draft_mask(num_drafts, k)  # [B, K]
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B]
    rows = torch.arange(b, device=target_probs.device)
    p_a = target_probs[rows, num_accepted]  # [B, V]
    q_pad = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)  # [B, K+1, V]
    q_a = q_pad[rows, num_accepted]  # [B, V]
    rejected = (num_accepted < num_drafts).unsqueeze(1)  # [B, 1]
    dist = torch.where(rejected, (p_a - q_a).clamp(min=0.0), p_a)  # [B, V]
    # p == q to the last bit leaves nothing to reject into; fall back to p
    empty = dist.sum(dim=1, keepdim=True) <= 0.0
    dist = torch.where(empty, p_a, dist)
    last = (dist.log() + gumbel[rows, num_accepted]).argmax(dim=1)  # [B]: draw from dist
    prefix = torch.cat([draft_tokens, torch.zeros_like(draft_tokens[:, :1])], dim=1)
    return num_accepted, _emit(prefix, num_accepted, last)


# -- the inputs, keyed by (seed, position) -------------------------------------
#
# Plain decoding draws the token at position p of a request with seed s from
# Gumbel noise keyed by (s, p) (sampling.py). Verification reuses that very noise
# for the target's pick (match rule) and for the residual / bonus draw (rejection
# rule); the draft model's own draws and the acceptance uniforms use other
# streams (the seed xor a constant), so all of them are independent yet replayable.

DRAFT_STREAM = 0x5EED_D4AF_7C0D_E001
ACCEPT_STREAM = 0x0ACC_E97E_D5EE_D002


def keyed_gumbel(keys: Seq[tuple[int, int]], vocab_size: int, stream: int = 0) -> torch.Tensor:
    """Gumbel noise ``[N, V]`` (CPU) for each (seed, position); stream 0 is the sampler's."""
    return gumbel_noise([(s ^ stream, p) for s, p in keys], vocab_size)


def keyed_uniforms(keys: Seq[tuple[int, int]], stream: int = ACCEPT_STREAM) -> torch.Tensor:
    """One uniform in [0, 1) per (seed, position): ``[N]`` float32 (CPU)."""
    out = torch.empty(len(keys), dtype=torch.float32)
    gen = torch.Generator(device="cpu")
    for i, (seed, pos) in enumerate(keys):
        gen.manual_seed(noise_seed(seed ^ stream, pos))
        torch.rand(1, generator=gen, out=out[i : i + 1])
    return out


def processed_logits(
    raw: torch.Tensor, seqs: Seq[Sequence], eos_token_ids: Seq[int], positions: Seq[int]
) -> torch.Tensor:
    """The sampler's view of ``raw`` ``[N, V]``: penalties (reading
    ``seq.token_ids[:position]``), min-tokens masks, then temperature, top-k,
    top-p, min-p. ``softmax`` of a row is the distribution plain decoding draws
    from at that position. Rows must be sampled (temperature > 0)."""
    if any(s.params.greedy for s in seqs):
        raise ValueError("processed_logits is for sampled rows; greedy rows take the argmax")
    x = raw.float().clone()
    pos = list(positions)
    _apply_penalties(x, seqs, pos)
    _mask_min_tokens(x, seqs, pos, eos_token_ids)
    return apply_sampling_masks(x, [s.params for s in seqs])
