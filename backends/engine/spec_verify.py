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

import torch

__all__ = [
    "accept_matches",
    "verify_deterministic",
    "verify_greedy",
    "verify_rejection",
]


def _draft_mask(num_drafts: torch.Tensor, k: int) -> torch.Tensor:
    """[B] counts -> [B, K] bool, True where a draft is real."""
    return torch.arange(k, device=num_drafts.device).unsqueeze(0) < num_drafts.unsqueeze(1)


def _emit(
    prefix: torch.Tensor, num_accepted: torch.Tensor, last: torch.Tensor
) -> torch.Tensor:
    """Output rows ``prefix[:a] + [last]`` padded with -1.
    prefix: [B, K+1] long; num_accepted, last: [B] -> [B, K+1]."""
    b, k1 = prefix.shape
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
