"""moed: the Python client of the moed Mixture-of-Experts layer server.

    import moed
    with moed.MoEClient("127.0.0.1:50051") as c:
        y = c.forward(0, x, expert_ids=ids, expert_weights=w)

MoEClient (numpy in, numpy out), the data types it returns (ModelInfo, LayerInfo, ForwardResult,
Timings, Device), MoEError for failed calls, and moed.reference, a float64 numpy reference of
what the server computes (imported on demand: `import moed.reference`).
"""

from .types import Device, ForwardResult, LayerInfo, ModelInfo, MoEError, Timings
from .client import MoEClient

__all__ = ["MoEClient", "MoEError", "ForwardResult", "ModelInfo", "LayerInfo", "Device", "Timings"]
__version__ = "0.1.0"
