"""How much to speculate: a measured cost model and one allocation rule. Pure
policy (no clock, no torch): the engine passes in what it measured.

Verifying ``k`` drafts adds ``k`` rows to the step's forward pass. Whether that pays
depends on two things this module estimates online:

* **cost** (:class:`StepCost`): step time against the number of rows the pass
  computes, from the engine's recent decode steps (older steps decay): a line
  ``a + b·rows`` plus a per-row-count table where kernels make it bumpy. On this
  project's CPUs one more row costs 5-15 % of a one-row step at batch 1 and 2-5 %
  of a step at batch 16 (bfloat16 and float32 alike), so neither "always
  speculate" nor a fixed batch-size cut-off is right.
* **acceptance**: how many drafts the target will accept. For prompt lookup the
  length ``m`` of the suffix match that produced a draft predicts it well (SmolLM2
  on the bench's copy tasks: a 1-token match is right about 1 time in 4, a match of
  8+ tokens almost always), so :class:`MatchAcceptance` keeps, per match-length
  bucket, the probability ``q`` that the first draft is accepted and ``beta``
  that draft ``j+1`` is accepted after draft ``j`` was (shared by all requests,
  decaying). A draft model gets a per-request geometric rate (:class:`AdaptiveK`).

:func:`plan_drafts` then picks every request's ``k`` for the step at once. Draft
``j`` of request ``i`` is worth ``g = q_i·beta_i^(j-1)`` expected tokens; the plan
takes the most valuable drafts, as many as maximise the step's expected tokens per
second ``N / t(rows)`` (and none unless that beats plain decoding by a margin).
That one rule grows k while acceptance is high, shrinks it when low, and turns
speculation off in large batches, where ``N`` is large and a row buys little.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

__all__ = [
    "AdaptiveK",
    "AdaptivePolicy",
    "Candidate",
    "MatchAcceptance",
    "StepCost",
    "best_k",
    "match_bucket",
    "plan_drafts",
]


# -- allocation -----------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """A request that could verify up to ``cap`` drafts: the first is accepted with
    probability ``q``, each later one with ``beta`` given the one before was."""

    q: float
    beta: float
    cap: int


def plan_drafts(
    candidates: Seq[Candidate],
    *,
    tokens: float,
    rows: int,
    step_time: Callable[[int], float],
    max_rows: int,
    min_gain: float = 0.0,
) -> list[int]:
    """Drafts per candidate maximising the step's expected tokens per second.

    ``tokens``: tokens the step yields without drafts (one per sampled request);
    ``rows``: rows it computes without drafts; ``step_time(r)``: seconds for a step
    of ``r`` rows (any shape: CPU kernels have steps in it); at most ``max_rows``.
    No drafts at all unless the best plan beats none by ``min_gain`` (relative):
    a margin for the estimates' error where speculation would barely pay.

    Draft ``j`` of a candidate is worth ``q·beta^(j-1)``, falling with ``j``, so for
    any number of extra rows the best drafts are the most valuable ones overall;
    only how many remains, and every count is tried."""
    gains = sorted(
        ((c.q * c.beta**j, i) for i, c in enumerate(candidates) for j in range(c.cap)),
        key=lambda g: -g[0],
    )
    gains = gains[: max(0, max_rows - rows)]
    plain = best = tokens / step_time(rows)
    best_j, n = 0, tokens
    for j, (g, _) in enumerate(gains, 1):
        n += g
        rate = n / step_time(rows + j)
        if rate > best * (1 + 1e-9):
            best_j, best = j, rate
    if best < plain * (1.0 + min_gain):
        best_j = 0
    ks = [0] * len(candidates)
    for _, i in gains[:best_j]:
        ks[i] += 1
    return ks


# -- cost ----------------------------------------------------------------------------


class StepCost:
    """Online estimate of a step's seconds as a function of the rows it computes.

    Two parts: an exponentially weighted least-squares line ``a + b·rows`` (with a
    weak ridge pulling ``b`` towards ``prior_row_cost · a``, so the slope stays
    defined while the rows hardly vary), and a table of recent step times per row
    count up to ``table_rows``, which wins where it has data: CPU matmul kernels
    change at small sizes (measured here, float32 at batch 1: 2 and 3 rows cost
    +5 % and +15 %, 4 rows +60 %), which no line captures."""

    def __init__(
        self,
        *,
        prior_row_cost: float = 0.1,
        decay: float = 0.97,
        prior_weight: float = 1.0,
        table_rows: int = 64,
        table_decay: float = 0.9,
        table_min: float = 2.0,
    ) -> None:
        self.prior_row_cost = prior_row_cost
        self.decay = decay
        self.prior_weight = prior_weight
        self.table_rows = table_rows
        self.table_decay = table_decay
        self.table_min = table_min  # decayed observations before a table entry is used
        self._sums = [0.0] * 5  # decayed: w, x, y, xx, xy
        self._table: dict[int, list[float]] = {}  # rows -> [decayed sum of seconds, weight]
        self.num_observed = 0

    def observe(self, rows: int, seconds: float) -> None:
        if rows < 1 or not seconds > 0:
            return
        if self.num_observed:
            guess = self.predict(rows)
            seconds = min(max(seconds, guess / 2.0), guess * 2.0)  # one stall is not a trend
        d, x, y = self.decay, float(rows), seconds
        self._sums = [v * d for v in self._sums]
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            self._sums[i] += v
        if rows <= self.table_rows:
            entry = self._table.setdefault(rows, [0.0, 0.0])
            entry[0] = self.table_decay * entry[0] + seconds
            entry[1] = self.table_decay * entry[1] + 1.0
        self.num_observed += 1

    def coefficients(self) -> tuple[float, float]:
        """The line: ``(a, b)`` seconds per step and per row (both > 0);
        ``(1.0, prior)`` before the first observation."""
        if self.num_observed == 0:
            return 1.0, self.prior_row_cost
        w, x, y, xx, xy = self._sums
        r, lam = self.prior_row_cost, self.prior_weight
        # minimise sum w (t - a - b rows)^2 + lam (b - r a)^2: the 2x2 normal equations
        m11, m12, m22 = w + lam * r * r, x - lam * r, xx + lam
        det = m11 * m22 - m12 * m12
        a = (y * m22 - xy * m12) / det
        b = (m11 * xy - m12 * y) / det
        mean_y = y / w
        return max(a, 0.05 * mean_y), max(b, 1e-3 * mean_y)  # neither is ever free

    def predict(self, rows: int) -> float:
        """Seconds for a step of ``rows`` rows: the table where it has data, else the line."""
        entry = self._table.get(rows)
        if entry is not None and entry[1] >= self.table_min:
            return entry[0] / entry[1]
        a, b = self.coefficients()
        return a + b * rows


# -- acceptance: prompt lookup ------------------------------------------------------

# Match lengths 1, 2, 3, 4, 5-7, 8-15, 16+ -> buckets 1..7; 0 means no match.
_BUCKET_STARTS = (1, 2, 3, 4, 5, 8, 16)
# Prior first-draft acceptance per bucket (weak: two pseudo-observations).
_PRIOR_Q = (0.0, 0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def match_bucket(match_len: int) -> int:
    """The acceptance bucket of a suffix match of ``match_len`` tokens (0: none)."""
    bucket = 0
    for i, start in enumerate(_BUCKET_STARTS, 1):
        if match_len >= start:
            bucket = i
    return bucket


class MatchAcceptance:
    """Acceptance of prompt-lookup drafts per (greedy?, match bucket), shared by all
    requests: ``q`` (first draft accepted) and ``beta`` (next accepted after an
    accepted one), as decayed success / trial counts over a weak prior. A bucket
    that planning keeps skipping is probed with one draft every ``probe_interval``
    skips, so a stale low estimate can recover."""

    def __init__(
        self, *, prior_beta: float = 0.8, prior_weight: float = 2.0, decay: float = 0.995,
        probe_interval: int = 32,
    ) -> None:
        self.prior_beta = prior_beta
        self.prior_weight = prior_weight
        self.decay = decay
        self.probe_interval = probe_interval
        self._q: dict[tuple[bool, int], list[float]] = {}
        self._beta: dict[tuple[bool, int], list[float]] = {}
        self._skipped: dict[tuple[bool, int], int] = {}

    def estimate(self, greedy: bool, match_len: int) -> tuple[float, float]:
        """``(q, beta)`` for a draft from a suffix match of ``match_len`` tokens."""
        key = (greedy, match_bucket(match_len))
        return _rate(self._q_counts(key)), _rate(self._beta_counts(key))

    def observe(self, greedy: bool, match_len: int, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        key = (greedy, match_bucket(match_len))
        _update(self._q_counts(key), self.decay, float(accepted > 0), 1.0)
        if accepted > 0 and proposed > 1:
            judged = accepted - 1 + (1 if accepted < proposed else 0)
            if judged > 0:
                _update(self._beta_counts(key), self.decay, accepted - 1.0, float(judged))

    def probe(self, greedy: bool, match_len: int, planned: int) -> bool:
        """Called with the planned k for a proposal; True when this skipped
        proposal should be verified anyway (one draft) to refresh its bucket."""
        key = (greedy, match_bucket(match_len))
        if planned > 0:
            self._skipped[key] = 0
            return False
        n = self._skipped.get(key, 0) + 1
        self._skipped[key] = 0 if n >= self.probe_interval else n
        return n >= self.probe_interval

    def _q_counts(self, key: tuple[bool, int]) -> list[float]:
        c = self._q.get(key)
        if c is None:
            p = _PRIOR_Q[key[1]]
            c = self._q[key] = [p * self.prior_weight, self.prior_weight]
        return c

    def _beta_counts(self, key: tuple[bool, int]) -> list[float]:
        c = self._beta.get(key)
        if c is None:
            c = self._beta[key] = [self.prior_beta * self.prior_weight, self.prior_weight]
        return c


def _rate(counts: list[float]) -> float:
    return counts[0] / counts[1] if counts[1] > 0 else 0.0


def _update(counts: list[float], decay: float, successes: float, trials: float) -> None:
    counts[0] = decay * counts[0] + successes
    counts[1] = decay * counts[1] + trials


# -- acceptance: draft model (per request, geometric) ---------------------------------


def best_k(alpha: float, k_max: int, cost: float) -> int:
    """The k in [0, k_max] maximising expected tokens per target pass
    ``(1 - alpha^(k+1)) / (1 - alpha)`` divided by the pass's cost ``1 + cost·k``."""
    best, best_gain = 0, 1.0
    for k in range(1, k_max + 1):
        tokens = k + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
        gain = tokens / (1.0 + cost * k)
        if gain > best_gain + 1e-12:
            best, best_gain = k, gain
    return best


@dataclass
class _Acceptance:
    successes: float  # decayed count of accepted drafts
    trials: float  # decayed count of drafts judged (accepted + the first rejected)
    idle: int = 0  # steps since k fell to 0


@dataclass(frozen=True)
class AdaptivePolicy:
    """The knobs of :class:`AdaptiveK` (``SpecConfig`` carries them)."""

    k_max: int
    enabled: bool = True
    draft_cost: float = 0.1  # drafting + verifying one more token, as a fraction of a step
    decay: float = 0.8  # EWMA weight of the past
    prior_acceptance: float = 0.6
    probe_interval: int = 8  # steps at k = 0 before probing with k = 1


class AdaptiveK:
    """Per-request k for draft-model proposals from an EWMA acceptance estimate.

    Under the geometric model each judged draft is accepted with probability
    alpha and judging stops at the first rejection, so accepted / (accepted +
    rejected) estimates alpha; both counts decay by ``decay`` per observation.
    The result is an upper bound: :func:`plan_drafts` still weighs it against the
    step's measured cost."""

    def __init__(self, policy: AdaptivePolicy) -> None:
        self.config = policy
        self._state: dict[str, _Acceptance] = {}

    def _get(self, seq_id: str) -> _Acceptance:
        st = self._state.get(seq_id)
        if st is None:
            prior = self.config.prior_acceptance
            st = self._state[seq_id] = _Acceptance(successes=2.0 * prior, trials=2.0)
        return st

    def acceptance(self, seq_id: str) -> float:
        st = self._get(seq_id)
        return st.successes / st.trials

    def k_for(self, seq_id: str) -> int:
        """How many drafts ``seq_id`` should propose at most."""
        c = self.config
        if not c.enabled:
            return c.k_max
        st = self._get(seq_id)
        k = best_k(st.successes / st.trials, c.k_max, c.draft_cost)
        if k > 0:
            st.idle = 0
            return k
        st.idle += 1
        if st.idle >= c.probe_interval:
            st.idle = 0
            return 1
        return 0

    def observe(self, seq_id: str, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        st, d = self._get(seq_id), self.config.decay
        st.successes = d * st.successes + accepted
        st.trials = d * st.trials + accepted + (1 if accepted < proposed else 0)

    def forget(self, seq_id: str) -> None:
        self._state.pop(seq_id, None)
