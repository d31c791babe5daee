"""moed: the Python client of the moed Mixture-of-Experts layer server.

    import moed
    with moed.connect("127.0.0.1:50051") as c:                  # or ["h1:50051", "h2:50051"]
        y = c.forward(0, x, expert_ids=ids, expert_weights=w)    # x: numpy, torch (CPU/CUDA), DLPack
    async with moed.aio.connect("127.0.0.1:50051") as c:
        y = await c.forward(0, x, expert_ids=ids, expert_weights=w)

connect() makes the client a target needs: MoEClient for one daemon, FleetClient for several (a
list of targets, or a "dns:" name with several addresses: daemons that split the layers and experts,
moed.fleet); both answer one interface (moed.interface.Client): forward(), forward_stream(), info(),
health(), register() and regions() (a fleet refuses the last two: MoEError FAILED_PRECONDITION).
moed.aio has their asyncio twins. RingClient makes same-host calls through the doorbell
(libmoedclient's rings, no grpcio on a call's path; numpy, torch CPU and CUDA tensors, stream-ordered
and capturable), and `import moed.torch_op` registers torch.ops.moed.forward on it (docs/engines.md). Links
(moed.links) make Forwards of torch CUDA tensors over NCCL, GPU to GPU. RetryPolicy for calls answered UNAVAILABLE; the data types they
return (ModelInfo, LayerInfo, ForwardResult, Timings, Device, RegionLimits, Region); MoEError for
failed calls. moed.tensors says what kinds of tensors go in and come out and what each costs;
moed.transport how they travel (inline, or shared or device memory when the server is on this
host); moed.regions the region session and arenas behind that; moed.wire is the hand-written
protobuf codec. moed.reference, a float64 numpy reference of what the server computes, is imported
on demand (`import moed.reference`; it needs ml_dtypes). Importing moed imports neither torch nor
protobuf nor ml_dtypes.
"""

from typing import Any

from .types import Device, ForwardResult, LayerInfo, ModelInfo, MoEError, Region, RegionLimits, Timings
from .retry import RetryPolicy
from .interface import Client
from .client import MoEClient
from .fleet import FleetClient
from .ring import ForwardHandle, RingClient
from .links import Links, open_links
from .targets import is_fleet, one
from . import aio

__all__ = ["connect", "Client", "MoEClient", "FleetClient", "RingClient", "ForwardHandle", "Links", "open_links", "MoEError", "RetryPolicy", "ForwardResult",
           "ModelInfo", "LayerInfo", "Device", "Timings", "Region", "RegionLimits", "aio"]
__version__ = "0.2.0"


def connect(target: Any = "127.0.0.1:50051", **kwargs) -> Client:
    """A client of target: a FleetClient when it names several daemons (a list of targets, or a
    "dns:" name that resolves to several addresses), else a MoEClient (a list of one: its item).
    Keyword arguments as MoEClient's (timeout, credentials, token, options, keepalive, retry,
    transport)."""
    if is_fleet(target):
        return FleetClient(target, **kwargs)
    return MoEClient(one(target), **kwargs)
