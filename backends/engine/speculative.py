"""Speculative decoding inside continuous batching: propose / verify / commit.

A speculative step is the plain engine's step with two more moves::

    schedule   the scheduler's plan; a decoding request computes 1 token
    propose    per decoding request k drafts (spec_policy.plan_drafts picks k, the
               n-gram or draft-model proposer fills them); lookahead blocks are
               allocated and the drafts appended to token_ids
    runner     ONE target pass over [last token, drafts]: logits at k+1 positions
    verify     the target's pick at each position through sample() with explicit
               positions (the same penalties and the same (seed, position) noise
               as plain decoding), then spec_verify.accept_matches, or
               verify_rejection for draft-model requests in rejection mode
    commit     scheduler.rollback drops rejected drafts (token ids, and blocks past
               the new end), then scheduler.commit with num_new_tokens = 1 +
               accepted: accepted drafts' KV counts as computed, and full blocks
               reach the prefix cache only now, so the cache never holds a draft
    outputs    1..k+1 tokens per request, cut at the first stop token

Ragged acceptance is the norm (each request accepts a different number per step);
requests with no proposal decode as usual in the same pass; a step in which nobody
verifies anything runs as the plain engine's step. With the match rule the output
is token-for-token what plain decoding produces (greedy and seeded sampling alike)
wherever the runner computes a row the same way however many rows its step has:
drafts never take a step past ``max_exact_rows`` (32, where CPU bfloat16 kernels
stop being row-invariant). CPU float32 is not row-invariant even below that (one
row runs a GEMV, 2-8 rows another kernel, 16 another), so there plain decoding
itself gives last-bit differences between batch sizes, and so does speculation.

Adaptivity (spec_policy): every step, :func:`plan_drafts` picks each request's k
from a cost model fitted online to this engine's own decode steps (seconds against
rows computed) and acceptance estimates: per suffix-match length for prompt lookup
(shared by all requests), per request for a draft model. A draft is verified only
while it raises the step's expected tokens per second, so k grows (up to K) while
acceptance is high, falls to 0 when it is low or when the batch is large enough
that a row costs more than it is expected to return. Requests without a proposal
decode as usual in the same pass.

K defaults to 15 for prompt lookup: a span of 1 + k <= 16 tokens after a cached
context is what the runner computes as one decode row per token (bit-identical to
decoding them one at a time); longer spans take the prefill path. 4 for a draft
model, whose every draft costs a pass of its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
import torch

from backends.base import Logprob
from backends.engine.config import EngineConfig
from backends.engine.engine import EngineStatistics, LLMEngine, StepOutput
from backends.engine.sampling import sample
from backends.engine.scheduler import ScheduledSeq, SchedulerOutput
from backends.engine.sequence import Sequence
from backends.engine.spec_policy import (
    AdaptiveK,
    AdaptivePolicy,
    Candidate,
    MatchAcceptance,
    StepCost,
    best_k,
    plan_drafts,
)
from backends.engine.spec_propose import (
    DraftProposer,
    Lookup,
    NgramProposer,
    TokenProposer,
    layer_skip_model,
)
from backends.engine.spec_verify import (
    ACCEPT_STREAM,
    accept_matches,
    keyed_gumbel,
    keyed_uniforms,
    processed_logits,
    verify_rejection,
)
from backends.errors import BadRequest

__all__ = [
    "AdaptiveK",
    "SpecConfig",
    "SpecEngineStatistics",
    "SpecStatistics",
    "SpeculativeEngine",
    "best_k",
    "build_draft_proposer",
    "make_engine",
]

Pos = Annotated[int, msgspec.Meta(gt=0)]
Frac = Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)]


# Drafts per request per step by default: prompt lookup up to the runner's exact
# short span (1 + 15 tokens), a draft model 4 (each draft is a draft-model pass).
DEFAULT_K = {"ngram": 15, "draft": 4, "off": 4}


class SpecConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``method``: off, ngram (prompt lookup) or draft (a draft model).
    ``num_speculative_tokens``: K, the most drafts per request per step (None:
    :data:`DEFAULT_K`); with ``adaptive`` the cost model picks 0..K every step.
    ``draft_verify``: for sampled requests with a draft model, "match" (draft with
    the target's noise; output identical to plain decoding) or "rejection"
    (draft from q, Leviathan/Chen rejection sampling)."""

    method: Literal["off", "ngram", "draft"] = "ngram"
    num_speculative_tokens: Annotated[int, msgspec.Meta(ge=1, le=32)] | None = None
    ngram_min: Pos = 1
    ngram_max: Pos = 8
    draft_verify: Literal["match", "rejection"] = "match"
    adaptive: bool = True
    max_batch_size: Pos | None = None  # a hard cut-off on top of the cost model
    # The runner computes a row the same way in any step of up to this many rows
    # (CPU, measured: oneDNN's packed bf16 GEMM and the 4-bit kernel up to 32 rows;
    # past it F.linear's result depends on the row count). Drafts never take a step
    # past it, and a step already past it gets none, so a token is computed as plain
    # decoding computes it.
    max_exact_rows: Pos = 32
    row_cost: Annotated[float, msgspec.Meta(gt=0.0)] = 0.1  # prior: one more row / one-row step
    min_gain: Annotated[float, msgspec.Meta(ge=0.0)] = 0.05  # speculate when it should pay this much
    cost_decay: Frac = 0.97  # weight of the past in the step-cost fit
    draft_cost: Annotated[float, msgspec.Meta(ge=0.0)] = 0.1  # draft model: one more token / step
    decay: Frac = 0.8  # draft model: EWMA weight of the past
    prior_acceptance: Frac = 0.6
    probe_interval: Pos = 8  # draft model: steps at k = 0 before probing with k = 1
    draft_model: str | None = None  # path of a cheaper model with the same vocabulary
    draft_layers: Pos | None = None  # or: draft with the target's first N layers

    @property
    def k_max(self) -> int:
        return self.num_speculative_tokens or DEFAULT_K[self.method]

    def adaptive_policy(self) -> AdaptivePolicy:
        return AdaptivePolicy(
            k_max=self.k_max,
            enabled=self.adaptive,
            draft_cost=self.draft_cost,
            decay=self.decay,
            prior_acceptance=self.prior_acceptance,
            probe_interval=self.probe_interval,
        )

    def __post_init__(self) -> None:
        if self.ngram_min > self.ngram_max:
            raise BadRequest("ngram_min must be <= ngram_max", param="ngram_min")
        if self.method == "draft" and (self.draft_model is None) == (self.draft_layers is None):
            raise BadRequest(
                "speculative method 'draft' needs exactly one of draft_model and draft_layers",
                param="draft_model",
            )


# -- statistics -----------------------------------------------------------------


class SpecStatistics(msgspec.Struct, frozen=True, kw_only=True):
    method: str
    num_speculative_tokens: int
    num_verified: int  # request-steps that verified at least one draft
    num_draft_tokens: int
    num_accepted_tokens: int
    num_emitted_tokens: int  # tokens out of those request-steps (accepted + 1 each, less stop cuts)
    acceptance_rate: float  # accepted / drafted
    mean_emitted_per_verify: float
    accepted_per_position: tuple[int, ...]  # [i]: times draft i was accepted
    num_no_proposal: int  # request-steps that wanted drafts and got none
    num_batch_cutoffs: int  # steps with proposals where none paid for its rows (cost model)
    num_lookahead_failures: int  # request-steps without blocks for drafts
    step_cost_s: float  # cost model: seconds per decode step ...
    row_cost_s: float  # ... plus this per row computed


class SpecEngineStatistics(EngineStatistics, frozen=True, kw_only=True):
    speculative: SpecStatistics


class _Counters:
    def __init__(self, k: int) -> None:
        self.verified = self.drafted = self.accepted = self.emitted = 0
        self.no_proposal = self.cutoffs = self.lookahead_failures = 0
        self.per_position = [0] * k

    def record(self, drafted: int, accepted: int, emitted: int) -> None:
        if drafted == 0:
            return
        self.verified += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += emitted
        for i in range(accepted):
            self.per_position[i] += 1


# -- the engine -----------------------------------------------------------------


@dataclass
class _Plan:
    """One step's speculative additions, aligned with ``plan.scheduled``."""

    sampled: list[bool]  # needed sampling before drafts were appended
    drafts: list[list[int]]
    probs: list[torch.Tensor | None]  # q per draft (rejection mode), else None
    lookahead: list[bool]  # blocks were allocated for drafts
    match: list[int]  # prompt lookup: the suffix match behind the drafts


class SpeculativeEngine(LLMEngine):
    """:class:`LLMEngine` with speculative decoding. The runner must accept
    ``execute(scheduled, logits_per_seq)`` (``runner.ModelRunner`` does).
    ``method="ngram"`` proposes with ``proposer`` (default: prompt lookup);
    ``method="draft"`` with ``draft``."""

    def __init__(
        self,
        config: EngineConfig,
        runner: Any,
        tokenizer: Any = None,
        *,
        spec: SpecConfig | None = None,
        draft: DraftProposer | None = None,
        proposer: TokenProposer | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(config, runner, tokenizer, **kwargs)
        self.spec = spec or SpecConfig()
        if self.spec.method == "draft" and draft is None:
            raise BadRequest("speculative method 'draft' needs a draft model", param="speculative")
        if draft is not None:
            draft.rejection = self.spec.draft_verify == "rejection"
        self.draft = draft
        self.ngram: TokenProposer = proposer or NgramProposer(
            min_n=self.spec.ngram_min, max_n=self.spec.ngram_max
        )
        self.adaptive = AdaptiveK(self.spec.adaptive_policy())
        self.acceptance = MatchAcceptance()
        self.cost = StepCost(prior_row_cost=self.spec.row_cost, decay=self.spec.cost_decay)
        self._counters = _Counters(self.spec.k_max)

    # -- requests -------------------------------------------------------------

    def _discard(self, request_id: str) -> Sequence | None:
        self._forget(request_id)
        return super()._discard(request_id)

    def _forget(self, seq_id: str) -> None:
        self.ngram.forget(seq_id)
        self.adaptive.forget(seq_id)
        if self.draft is not None:
            self.draft.forget(seq_id)

    # -- the loop -------------------------------------------------------------

    def _kv_runners(self) -> list[Any]:
        draft = getattr(self.draft, "runner", None)
        return [self.runner] if draft is None else [self.runner, draft]

    def _run(self, plan: SchedulerOutput, outputs: list[StepOutput]) -> None:
        if self.spec.method == "off":
            super()._run(plan, outputs)
            return
        t0 = time.perf_counter()
        sp = self._propose(plan)
        if not any(sp.lookahead):  # nothing to verify: the plain step, without its overhead
            first = len(outputs)
            super()._run(plan, outputs)
            for o in outputs[first:]:
                if o.finished:
                    self._forget(o.request_id)
            self._observe_cost(plan, 0, t0)
            return
        items = [
            ScheduledSeq(s.seq, s.num_new_tokens + len(d), start=s.start)
            for s, d in zip(plan.scheduled, sp.drafts, strict=True)
        ]
        counts = [len(d) + 1 if f else 0 for d, f in zip(sp.drafts, sp.sampled, strict=True)]
        logits = self.runner.execute(items, counts)  # [sum(counts), V]
        verified = self._verify(plan, sp, logits)
        self._commit(plan, sp, verified, outputs)
        self._observe_cost(plan, sum(len(d) for d in sp.drafts), t0)

    def _observe_cost(self, plan: SchedulerOutput, drafts: int, t0: float) -> None:
        """Decode steps (no prompt chunk) feed the cost model: rows -> seconds."""
        if all(s.num_new_tokens == 1 for s in plan.scheduled):
            self.cost.observe(plan.num_batched_tokens + drafts, time.perf_counter() - t0)

    # -- propose --------------------------------------------------------------

    def _propose(self, plan: SchedulerOutput) -> _Plan:
        n = len(plan.scheduled)
        sp = _Plan(
            [s.needs_sampling for s in plan.scheduled],
            [[] for _ in range(n)],
            [None] * n,
            [False] * n,
            [0] * n,
        )
        decoding = [
            i for i, s in enumerate(plan.scheduled) if sp.sampled[i] and s.num_new_tokens == 1
        ]
        if not decoding:
            return sp
        cap = self.spec.max_batch_size
        if (cap is not None and len(decoding) > cap) or self._row_limit(plan) <= 0:
            self._counters.cutoffs += 1
            return sp
        if self.spec.method == "ngram":
            self._propose_ngram(plan, sp, decoding)
        else:
            self._propose_draft(plan, sp, decoding)
        for s, d in zip(plan.scheduled, sp.drafts, strict=True):
            s.seq.token_ids.extend(d)
        return sp

    def _room(self, seq: Sequence) -> int:
        """Drafts that cannot overrun K, max_tokens or the context (k drafts emit up to k+1)."""
        return min(
            self.spec.k_max,
            seq.params.max_tokens - seq.num_output_tokens - 1,
            self.max_model_len - len(seq.token_ids) - 1,
        )

    def _row_limit(self, plan: SchedulerOutput) -> int:
        """How many draft rows the step may add: the token budget, and never past
        ``max_exact_rows``."""
        limit = min(self.config.max_num_batched_tokens, self.spec.max_exact_rows)
        return limit - plan.num_batched_tokens

    def _plan(self, plan: SchedulerOutput, sp: _Plan, cands: dict[int, Candidate]) -> list[int]:
        """k per candidate: the cost model's choice (adaptive), else all it has,
        within the step's row limit."""
        left = self._row_limit(plan)
        if not self.spec.adaptive:
            ks = []
            for c in cands.values():
                ks.append(max(0, min(c.cap, left)))
                left -= ks[-1]
            return ks
        ks = plan_drafts(
            list(cands.values()), tokens=sum(sp.sampled), rows=plan.num_batched_tokens,
            step_time=self.cost.predict, max_rows=plan.num_batched_tokens + left,
            min_gain=self.spec.min_gain,
        )
        if cands and not any(ks):
            self._counters.cutoffs += 1
        return ks

    def _lookahead(self, sp: _Plan, i: int, seq: Sequence, k: int) -> bool:
        """Blocks for k drafts on top of the scheduled token; False (nothing
        changed) when the cache is full: that request just decodes."""
        if self.block_manager.allocate(seq, 1 + k):
            sp.lookahead[i] = True
            return True
        self._counters.lookahead_failures += 1
        return False

    def _propose_ngram(self, plan: SchedulerOutput, sp: _Plan, decoding: list[int]) -> None:
        looks: dict[int, Lookup] = {}
        cands: dict[int, Candidate] = {}
        for i in decoding:
            seq = plan.scheduled[i].seq
            room = self._room(seq)
            if room <= 0:
                continue
            lk = self.ngram.lookup(seq.seq_id, seq.token_ids, room)
            if not lk.tokens:
                self._counters.no_proposal += 1
                continue
            q, beta = self.acceptance.estimate(seq.params.greedy, lk.match)
            looks[i], cands[i] = lk, Candidate(q, beta, len(lk.tokens))
        ks = self._plan(plan, sp, cands)
        spare = self._row_limit(plan) - sum(ks)
        for i, k in zip(cands, ks, strict=True):
            lk, seq = looks[i], plan.scheduled[i].seq
            probe = self.spec.adaptive and self.acceptance.probe(seq.params.greedy, lk.match, k)
            if probe and spare > 0:  # a bucket planning keeps skipping: one draft refreshes it
                k, spare = 1, spare - 1
            if k > 0 and self._lookahead(sp, i, seq, k):
                sp.drafts[i], sp.match[i] = lk.tokens[:k], lk.match

    def _propose_draft(self, plan: SchedulerOutput, sp: _Plan, decoding: list[int]) -> None:
        assert self.draft is not None  # checked in __init__
        cands: dict[int, Candidate] = {}
        for i in decoding:
            seq = plan.scheduled[i].seq
            k = min(self.adaptive.k_for(seq.seq_id), self._room(seq))
            if k > 0:
                alpha = self.adaptive.acceptance(seq.seq_id)
                cands[i] = Candidate(alpha, alpha, k)
        ks = dict(zip(cands, self._plan(plan, sp, cands), strict=True))
        idx = [i for i, k in ks.items() if k > 0 and self._lookahead(sp, i, plan.scheduled[i].seq, k)]
        seqs = [plan.scheduled[i].seq for i in idx]
        prop = self.draft.propose(seqs, [ks[i] for i in idx], self.eos_token_ids)
        for j, i in enumerate(idx):
            sp.drafts[i] = prop.tokens[j]
            sp.probs[i] = prop.probs[j]

    # -- verify ---------------------------------------------------------------

    def _verify(
        self, plan: SchedulerOutput, sp: _Plan, logits: torch.Tensor
    ) -> dict[int, tuple[list[int], list[Logprob | None], int]]:
        """Per sampled item: (emitted tokens, their logprobs, drafts accepted)."""
        rows: list[tuple[int, Sequence, int]] = []  # (item, seq, position)
        for i, s in enumerate(plan.scheduled):
            if sp.sampled[i]:
                rows += [(i, s.seq, s.end + j) for j in range(len(sp.drafts[i]) + 1)]
        results = sample(logits, [r[1] for r in rows], self.eos_token_ids, [r[2] for r in rows])
        first: dict[int, int] = {}
        for r, (i, _, _) in enumerate(rows):
            first.setdefault(i, r)
        items = list(first)
        k_max = max((len(sp.drafts[i]) for i in items), default=0)
        target = _pad(
            [[results[first[i] + j][0] for j in range(len(sp.drafts[i]) + 1)] for i in items],
            k_max + 1,
        )
        drafts = _pad([sp.drafts[i] for i in items], k_max)
        num = torch.tensor([len(sp.drafts[i]) for i in items], dtype=torch.long)
        acc, out = accept_matches(target, drafts, num)
        rej = [b for b, i in enumerate(items) if sp.probs[i] is not None and sp.drafts[i]]
        if rej:
            self._verify_rejection(plan, sp, logits, [items[b] for b in rej], first, acc, out, rej)
        verified: dict[int, tuple[list[int], list[Logprob | None], int]] = {}
        for b, i in enumerate(items):
            a = int(acc[b])
            toks = out[b, : a + 1].tolist()
            lps = [
                _relabel(results[first[i] + j][1], logits[first[i] + j], t)
                for j, t in enumerate(toks)
            ]
            verified[i] = (toks, lps, a)
        return verified

    def _verify_rejection(
        self,
        plan: SchedulerOutput,
        sp: _Plan,
        logits: torch.Tensor,
        items: list[int],
        first: dict[int, int],
        acc: torch.Tensor,
        out: torch.Tensor,
        batch_rows: list[int],
    ) -> None:
        """Leviathan/Chen for draft-sampled requests; writes into acc/out rows."""
        k_max = max(len(sp.drafts[i]) for i in items)
        v = logits.shape[1]
        p = torch.zeros(len(items), k_max + 1, v)  # [R, K+1, V]
        q = torch.zeros(len(items), k_max, v)  # [R, K, V]
        u = torch.ones(len(items), k_max)  # [R, K]
        g = torch.zeros(len(items), k_max + 1, v)  # [R, K+1, V]
        for r, i in enumerate(items):
            seq, k, end = plan.scheduled[i].seq, len(sp.drafts[i]), plan.scheduled[i].end
            pos = [end + j for j in range(k + 1)]
            y = processed_logits(
                logits[first[i] : first[i] + k + 1], [seq] * (k + 1), self.eos_token_ids, pos
            )
            p[r, : k + 1] = y.softmax(dim=-1).float().cpu()
            probs = sp.probs[i]
            if probs is not None:  # always, for the items passed here
                q[r, :k] = probs
            keys = [(seq.params.seed or 0, x) for x in pos]
            u[r, :k] = keyed_uniforms(keys[:k], ACCEPT_STREAM)
            g[r, : k + 1] = keyed_gumbel(keys, v)
        drafts = _pad([sp.drafts[i] for i in items], k_max)
        num = torch.tensor([len(sp.drafts[i]) for i in items], dtype=torch.long)
        r_acc, r_out = verify_rejection(p, q, drafts, num, u, g)
        for r, b in enumerate(batch_rows):
            acc[b] = r_acc[r]
            out[b] = -1
            out[b, : r_out.shape[1]] = r_out[r]

    # -- commit ---------------------------------------------------------------

    def _commit(
        self,
        plan: SchedulerOutput,
        sp: _Plan,
        verified: dict[int, tuple[list[int], list[Logprob | None], int]],
        outputs: list[StepOutput],
    ) -> None:
        items: list[ScheduledSeq] = []
        tokens: list[int] = []
        emitted: list[tuple[Sequence, list[int], list[Logprob | None]]] = []
        for i, s in enumerate(plan.scheduled):
            if not sp.sampled[i]:
                items.append(s)
                continue
            toks, lps, a = verified[i]
            m = self._stop_cut(s, toks)
            toks, lps = toks[:m], lps[:m]
            if sp.lookahead[i]:
                self.scheduler.rollback(s.seq, s.end + m - 1)  # keep the accepted drafts only
            items.append(ScheduledSeq(s.seq, s.num_new_tokens + m - 1, start=s.start))
            tokens.append(toks[-1])
            emitted.append((s.seq, toks, lps))
            if self.spec.method == "ngram":
                self.acceptance.observe(s.seq.params.greedy, sp.match[i], len(sp.drafts[i]), a)
            else:
                self.adaptive.observe(s.seq.seq_id, len(sp.drafts[i]), a)
            self._counters.record(len(sp.drafts[i]), a, m)
        self.scheduler.commit(
            SchedulerOutput(
                scheduled=items,
                preempted=plan.preempted,
                num_batched_tokens=plan.num_batched_tokens,
            ),
            tokens,
        )
        for seq, toks, lps in emitted:
            if self.draft is not None:
                self.draft.accepted(seq, len(seq.token_ids))
            outputs.append(self._after_tokens(seq, toks, lps))

    def _stop_cut(self, item: ScheduledSeq, toks: list[int]) -> int:
        """How many of ``toks`` to emit: through the first stop token, and never
        past max_tokens or the context."""
        seq, p = item.seq, item.seq.params
        limit = min(
            p.max_tokens - (item.end - seq.num_prompt_tokens),
            self.max_model_len - item.end,
            len(toks),
        )
        for j, t in enumerate(toks[:limit]):
            if t in p.stop_token_ids or (not p.ignore_eos and t in self.eos_token_ids):
                return j + 1
        return max(limit, 1)

    def _after_tokens(
        self, seq: Sequence, toks: list[int], lps: list[Logprob | None]
    ) -> StepOutput:
        self._generated += len(toks)
        self.meter.generated(seq.seq_id, len(toks))
        event = self._stop_event(seq, toks[-1])
        if event is not None:
            self.scheduler.finish(seq, event)
            self._finished += 1
            self._forget(seq.seq_id)
        logprobs = None if seq.params.logprobs is None else [lp for lp in lps if lp is not None]
        return self._output(seq, toks, logprobs)

    # -- introspection --------------------------------------------------------

    def statistics(self) -> SpecEngineStatistics:
        base = super().statistics()
        return SpecEngineStatistics(
            **msgspec.structs.asdict(base), speculative=self.spec_statistics()
        )

    def spec_statistics(self) -> SpecStatistics:
        c = self._counters
        a, b = self.cost.coefficients() if self.cost.num_observed else (0.0, 0.0)
        return SpecStatistics(
            method=self.spec.method,
            num_speculative_tokens=self.spec.k_max,
            num_verified=c.verified,
            num_draft_tokens=c.drafted,
            num_accepted_tokens=c.accepted,
            num_emitted_tokens=c.emitted,
            acceptance_rate=c.accepted / c.drafted if c.drafted else 0.0,
            mean_emitted_per_verify=c.emitted / c.verified if c.verified else 0.0,
            accepted_per_position=tuple(c.per_position),
            num_no_proposal=c.no_proposal,
            num_batch_cutoffs=c.cutoffs,
            num_lookahead_failures=c.lookahead_failures,
            step_cost_s=a,
            row_cost_s=b,
        )


def _pad(rows: list[list[int]], width: int) -> torch.Tensor:
    """Ragged token lists -> ``[len(rows), width]`` long, padded with -1."""
    out = torch.full((len(rows), width), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        if row:
            out[r, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def _relabel(lp: Logprob | None, raw: torch.Tensor, token: int) -> Logprob | None:
    """The sampler's logprob record for its own pick, moved to ``token`` when
    rejection sampling emitted another one (the alternatives are the same)."""
    if lp is None or lp.token_id == token:
        return lp
    value = float(raw.float().log_softmax(dim=-1)[token])
    return Logprob(token_id=token, logprob=value, top=lp.top)


# -- wiring: draft construction ---------------------------------------


def build_draft_proposer(
    target_runner: Any, *, draft_model: str | None = None, draft_layers: int | None = None
) -> DraftProposer:
    """A draft runner sharing the target's block geometry: the target's first
    ``draft_layers`` layers, or the model at ``draft_model``."""
    from backends.engine.loader import load_model
    from backends.engine.runner import ModelRunner

    if (draft_model is None) == (draft_layers is None):
        raise BadRequest(
            "give exactly one of --draft-model and --draft-layers", param="draft_model"
        )
    if draft_layers is not None:
        model = layer_skip_model(target_runner.model, draft_layers)
    else:
        model = load_model(
            draft_model, dtype=target_runner.dtype, device=target_runner.device
        ).model
    if model.args.vocab_size != target_runner.args.vocab_size:
        raise BadRequest(
            "the draft model's vocabulary differs from the target's", param="draft_model"
        )
    runner = ModelRunner(
        model,
        target_runner.num_kv_blocks,
        target_runner.block_size,
        target_runner.device,
        target_runner.dtype,
        # a layer-skip draft shares the target's modules: the same kernels for both
        batch_invariant=getattr(target_runner, "batch_invariant", True),
        kv_idle_blocks=getattr(target_runner, "kv_idle_blocks", None),
    )
    return DraftProposer(runner)


def make_engine(
    config: EngineConfig, runner: Any, tokenizer: Any = None, spec: SpecConfig | None = None
) -> LLMEngine:
    """The engine ``spec`` asks for: plain when off (or None), else speculative
    (building the draft runner for method "draft")."""
    if spec is None or spec.method == "off":
        return LLMEngine(config, runner, tokenizer)
    draft = None
    if spec.method == "draft":
        draft = build_draft_proposer(
            runner, draft_model=spec.draft_model, draft_layers=spec.draft_layers
        )
    return SpeculativeEngine(config, runner, tokenizer, spec=spec, draft=draft)
