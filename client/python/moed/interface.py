"""What every moed client answers, whether it talks to one daemon (moed.MoEClient,
moed.aio.MoEClient) or to a fleet of them (moed.FleetClient, moed.aio.FleetClient): Client, and
AioClient for the asyncio ones, whose methods are the same, awaited. moed.connect and
moed.aio.connect make the one a target needs. moed.MoEClient's methods document the arguments; the
fleet clients take the same. A call a fleet cannot serve (register, unregister and regions, which
need one daemon; forward with transport shm or cuda) raises MoEError FAILED_PRECONDITION saying why.
"""

from __future__ import annotations

import abc
from typing import Any, Dict, List, Optional

from .types import ModelInfo, Region


class Client(abc.ABC):
    """A blocking client. Attributes: target, timeout (the default deadline), retry (RetryPolicy),
    transport (the default), transport_calls (Forward calls made per transport). Use as a context
    manager, or call close()."""

    target: Any
    timeout: Optional[float]
    transport: str
    transport_calls: Dict[str, int]

    @abc.abstractmethod
    def forward(self, layer: int, hidden: Any, **kwargs) -> Any:
        """MoE layer `layer` for hidden [T, d_model]: the output (or a ForwardResult)."""

    @abc.abstractmethod
    def forward_stream(self, requests: Any, **kwargs) -> Any:
        """forward() of each item (a dict of its keyword arguments), yielding the outputs in order."""

    @abc.abstractmethod
    def info(self, timeout: Optional[float] = None) -> ModelInfo:
        """What the server (or the fleet) holds."""

    @abc.abstractmethod
    def health(self, service: str = "", timeout: Optional[float] = None) -> str:
        """"SERVING", "NOT_SERVING", "UNKNOWN" or "SERVICE_UNKNOWN"."""

    @abc.abstractmethod
    def register(self, tensor: Any) -> Any:
        """Registers a torch CUDA tensor as a region (one daemon on this host)."""

    @abc.abstractmethod
    def unregister(self, registration: Any) -> None:
        """Ends a registration made by register()."""

    @abc.abstractmethod
    def regions(self, timeout: Optional[float] = None) -> List[Region]:
        """The regions of this client's principal on the daemon (ListRegions)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Lets go of every connection; calls in flight are cancelled."""

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AioClient(abc.ABC):
    """An asyncio client: Client's methods, awaited (forward_stream an async generator). Use
    `async with`, or await close()."""

    target: Any
    timeout: Optional[float]
    transport: str
    transport_calls: Dict[str, int]

    @abc.abstractmethod
    async def forward(self, layer: int, hidden: Any, **kwargs) -> Any:
        """Client.forward, awaited."""

    @abc.abstractmethod
    def forward_stream(self, requests: Any, **kwargs) -> Any:
        """Client.forward_stream as an async generator."""

    @abc.abstractmethod
    async def info(self, timeout: Optional[float] = None) -> ModelInfo:
        """Client.info, awaited."""

    @abc.abstractmethod
    async def health(self, service: str = "", timeout: Optional[float] = None) -> str:
        """Client.health, awaited."""

    @abc.abstractmethod
    async def register(self, tensor: Any) -> Any:
        """Client.register, awaited."""

    @abc.abstractmethod
    async def unregister(self, registration: Any) -> None:
        """Client.unregister, awaited."""

    @abc.abstractmethod
    async def regions(self, timeout: Optional[float] = None) -> List[Region]:
        """Client.regions, awaited."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Client.close, awaited."""

    async def __aenter__(self) -> "AioClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
