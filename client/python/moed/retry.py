"""RetryPolicy: when a call that failed UNAVAILABLE is tried again, and after how long.

moed answers UNAVAILABLE when its queue is full or it is draining, and gRPC does when the server
cannot be reached: in each case the request was not computed, and Forward has no side effects, so
sending it again is safe. Nothing else is retried: every other status says something about the
request or the deadline that another attempt would not change.
"""

from __future__ import annotations

import math
import numbers
import random
from dataclasses import dataclass
from typing import Callable, Optional

import grpc

from .types import InvalidArgument


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of UNAVAILABLE with jittered exponential backoff, bounded in attempts and by the
    call's deadline.

    max_attempts: attempts in all, the first included (1: never retry). The wait before retry n
    (n = 1, 2, ...) is uniform in [0, min(max_backoff, initial_backoff * multiplier ** (n - 1))]
    seconds ("full jitter", as gRPC's own retries, so that callers turned away together do not
    come back together). A retry that would not end before the call's deadline (its wait, plus
    as long as the failed attempt took) is not made: the call fails with the UNAVAILABLE it got,
    not later with DEADLINE_EXCEEDED.
    On a stream, the count restarts with every reply received.
    """

    max_attempts: int = 3
    initial_backoff: float = 0.05
    max_backoff: float = 1.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        for name in ("max_attempts", "initial_backoff", "max_backoff", "multiplier"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
                raise InvalidArgument(f"{name} = {value!r}: give a number")
        if self.max_attempts < 1:
            raise InvalidArgument(f"max_attempts = {self.max_attempts}: at least 1 (the first attempt)")
        if not (self.initial_backoff > 0 and self.max_backoff >= self.initial_backoff):
            raise InvalidArgument("backoffs must satisfy 0 < initial_backoff <= max_backoff")
        if not self.multiplier >= 1:
            raise InvalidArgument(f"multiplier = {self.multiplier}: at least 1")

    def delay(self, failures: int, code: Optional[grpc.StatusCode], now: float, deadline: Optional[float],
              took: float = 0.0, rand: Callable[[], float] = random.random) -> Optional[float]:
        """Seconds to wait before the next attempt, after `failures` attempts in a row failed and
        the last, which took `took` seconds, with `code`; None when the call must fail now: another
        status, no attempts left, or the deadline (a time.monotonic() value, or None) would pass
        before the wait and another attempt as long as the last one are over."""
        if code != grpc.StatusCode.UNAVAILABLE or failures >= self.max_attempts:
            return None
        wait = rand() * min(self.max_backoff, self.initial_backoff * self.multiplier ** (failures - 1))
        if deadline is not None and now + wait + took >= deadline:
            return None
        return wait


NO_RETRY = RetryPolicy(max_attempts=1)
