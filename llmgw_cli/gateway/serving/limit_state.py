"""What one gateway process keeps for per-key limits (``limiting.py`` uses it)."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from llmgw_cli.core.serving.ratelimit import Limiter


@dataclass
class LimitState:
    """One gateway process's: its allowances, the store calls under way (shared by the
    requests that need the same one), when an unreachable store was last logged."""

    limiter: Limiter = field(default_factory=Limiter)
    calls: dict[tuple[str, str, str, str], asyncio.Future[bool]] = field(default_factory=dict)
    warned: float = -math.inf
