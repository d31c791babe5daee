"""moed: the Python client of the moed Mixture-of-Experts layer server.

    import moed
    with moed.MoEClient("127.0.0.1:50051") as c:
        y = c.forward(0, x, expert_ids=ids, expert_weights=w)    # x: numpy, torch (CPU/CUDA), DLPack
    async with moed.aio.MoEClient("127.0.0.1:50051") as c:
        y = await c.forward(0, x, expert_ids=ids, expert_weights=w)

MoEClient (blocking) and moed.aio.MoEClient (asyncio): forward(), forward_stream(), info(),
health(), register() and regions(); given several targets (a list, or a "dns:" name with several
addresses) they are fleet clients over daemons that split the layers and experts (moed.fleet);
RetryPolicy for calls answered UNAVAILABLE; the data types they return (ModelInfo, LayerInfo,
ForwardResult, Timings, Device, RegionLimits, Region); MoEError for failed calls. moed.tensors says
what kinds of tensors go in and come out and what each costs; moed.transport how they travel
(inline, or shared or device memory when the server is on this host); moed.regions the region
session and arenas behind that; moed.wire is the hand-written protobuf codec. moed.reference, a
float64 numpy reference of what
the server computes, is imported on demand (`import moed.reference`; it needs ml_dtypes).
Importing moed imports neither torch nor protobuf nor ml_dtypes.
"""

from .types import Device, ForwardResult, LayerInfo, ModelInfo, MoEError, Region, RegionLimits, Timings
from .retry import RetryPolicy
from .client import MoEClient
from . import aio
from . import fleet

__all__ = ["MoEClient", "MoEError", "RetryPolicy", "ForwardResult", "ModelInfo", "LayerInfo", "Device",
           "Timings", "Region", "RegionLimits", "aio", "fleet"]
__version__ = "0.2.0"
