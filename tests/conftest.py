"""Suite-wide fixtures.

Torch runs on one thread in tests: the models are tiny, CI has two cores,
and tests often run a server process beside the test process; on shared
cores torch's default thread count was measured up to 8x slower."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
