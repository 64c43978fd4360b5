"""The head's near-ties: a bfloat16 head rounds logits to 8 bits, so the engine
re-scores the tokens within one rounding step of each row's maximum in float32."""

from __future__ import annotations

import torch

from backends.engine.model import refine_top_logits


def _near_tie() -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [1, 64], weight [8, 64] bfloat16: tokens 2 and 5 score 25.31 and 25.30
    accumulated in float32, which both round to 25.25 in bfloat16."""
    hidden = torch.zeros(1, 64, dtype=torch.bfloat16)
    hidden[0, :2] = 1.0
    weight = torch.zeros(8, 64, dtype=torch.bfloat16)
    weight[:, 0] = torch.tensor([3.0, 10.0, 25.0, 1.0, -4.0, 25.0, 20.0, 0.5])
    weight[2, 1], weight[5, 1] = 0.3125, 0.3046875  # exact in bfloat16
    return hidden, weight


def test_a_bfloat16_tie_is_ranked_as_float32_ranks_it() -> None:
    hidden, weight = _near_tie()
    rounded = (hidden @ weight.T).float()
    assert rounded[0, 2] == rounded[0, 5]  # the bfloat16 head cannot tell them apart
    assert int(rounded.argmax()) == 2  # (by luck of the index order here)
    swapped = weight[[0, 1, 5, 3, 4, 2, 6, 7]]  # now the worse one comes first
    logits = (hidden @ swapped.T).float()
    assert int(logits.argmax()) == 2
    refine_top_logits(logits, hidden, swapped)
    exact = hidden.float() @ swapped.float().T
    assert int(logits.argmax()) == 5 == int(exact.argmax())
    assert torch.allclose(logits[0, [2, 5]], exact[0, [2, 5]], rtol=0, atol=1e-5)
    # Tokens further than a step from the maximum keep their rounded values.
    others = [0, 1, 3, 4, 6, 7]
    assert torch.equal(logits[0, others], (hidden @ swapped.T).float()[0, others])


def test_refinement_is_row_by_row() -> None:
    torch.manual_seed(0)
    weight = torch.randn(500, 64).to(torch.bfloat16)
    hidden = torch.randn(6, 64).to(torch.bfloat16)
    batch = (hidden @ weight.T).float()
    refine_top_logits(batch, hidden, weight)
    for i in range(6):
        alone = (hidden[i : i + 1] @ weight.T).float()
        refine_top_logits(alone, hidden[i : i + 1], weight)
        assert torch.equal(alone[0], batch[i])
    exact = hidden.float() @ weight.float().T
    assert torch.equal(batch.argmax(-1), exact.argmax(-1))


class _OneRank:
    """The single-rank view of tp.Comm that VocabParallelHead needs."""

    def gather_cols(self, t: torch.Tensor, widths: list[int]) -> torch.Tensor:
        assert list(widths) == [t.shape[1]]
        return t


def test_a_vocab_parallel_head_refines_its_shard() -> None:
    from torch import nn

    from backends.engine.tp import VocabParallelHead

    hidden, weight = _near_tie()
    swapped = weight[[0, 1, 5, 3, 4, 2, 6, 7]]
    head = VocabParallelHead(nn.Parameter(swapped, requires_grad=False), [8], _OneRank())  # type: ignore[arg-type]
    logits = head(hidden)
    assert logits.dtype == torch.float32
    assert int(logits.argmax()) == 5 == int((hidden.float() @ swapped.float().T).argmax())
