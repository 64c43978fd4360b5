"""Load every HTTP check module, in the order the table shows them."""

from __future__ import annotations

from . import checks_api, checks_errors, checks_load, checks_params, checks_tokens
from .suite import HTTP

__all__ = ["HTTP"]

# Load checks last: they may leave the target busy for a moment.
_MODULES = (checks_api, checks_params, checks_tokens, checks_errors, checks_load)
