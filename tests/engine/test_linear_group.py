"""LinearGroup (the fused/prepacked linears of the engine) is bit-identical
to running each nn.Linear on its own, and notices in-place weight edits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from backends.engine.model import LinearGroup


def _linears(dtype: torch.dtype, sizes: tuple[int, ...] = (48, 16, 16), bias: bool = False) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(64, n, bias=bias).to(dtype) for n in sizes]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("share", [False, True])
def test_group_matches_separate_linears_bit_for_bit(dtype: torch.dtype, share: bool) -> None:
    linears = _linears(dtype)
    group = LinearGroup(*linears, share_storage=share)
    with torch.inference_mode():
        for rows in (1, 2, 7, 16, 32, 33, 100):
            x = torch.randn(rows, 64).to(dtype)
            for got, want in zip(group(x), [lin(x) for lin in linears], strict=True):
                assert torch.equal(got, want), (dtype, share, rows)


def test_group_sees_an_in_place_weight_edit() -> None:
    linears = _linears(torch.bfloat16)
    group = LinearGroup(*linears, share_storage=True)
    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.inference_mode():
        before = group(x)[0].clone()
        linears[0].weight.mul_(2)
        after = group(x)[0]
        assert not torch.equal(before, after)
        assert torch.equal(after, linears[0](x))
