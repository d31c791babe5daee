"""moed.aio: the asyncio clients, on grpc.aio, with the blocking clients' methods awaited.

    async with moed.aio.connect("127.0.0.1:50051") as c:
        y = await c.forward(0, x, expert_ids=ids, expert_weights=w)
        async for y in c.forward_stream(requests):
            ...

MoEClient talks to one daemon, FleetClient to several (moed.fleet says what a fleet does); both
answer moed.interface.AioClient, and connect() makes the one a target needs. Arguments, results,
errors, retries and transports are those of moed.MoEClient (see there); only the waiting differs.
A client belongs to the event loop it was created in, as grpc.aio channels do.
"""

from __future__ import annotations

from typing import Any

from .aio_client import MoEClient
from .aio_fleet import FleetClient
from .interface import AioClient
from .targets import is_fleet, one

__all__ = ["MoEClient", "FleetClient", "AioClient", "connect"]


def connect(target: Any = "127.0.0.1:50051", **kwargs) -> AioClient:
    """moed.connect's asyncio twin: a FleetClient when target names several daemons, else a
    MoEClient; keyword arguments as theirs."""
    if is_fleet(target):
        return FleetClient(target, **kwargs)
    return MoEClient(one(target), **kwargs)
