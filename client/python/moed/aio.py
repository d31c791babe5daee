"""moed.aio.MoEClient: the asyncio client, on grpc.aio, with the blocking client's methods.

    async with moed.aio.MoEClient("127.0.0.1:50051") as c:
        y = await c.forward(0, x, expert_ids=ids, expert_weights=w)
        async for y in c.forward_stream(requests):
            ...

Arguments, results, errors, retries and transports are those of moed.MoEClient (see there); only
the waiting differs. The client belongs to the event loop it was created in, as grpc.aio channels do.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Optional

import grpc
import grpc.aio

from . import _common as C
from .types import ModelInfo


def _status_hidden(e: grpc.RpcError) -> bool:
    """Whether grpc.aio replaced a stream's status by its own INTERNAL: it does when a request
    write races the server's end of the stream (grpc/grpc issue 36066), so a stream the server
    ended with UNAVAILABLE or NOT_FOUND may report "Internal error from Core" instead."""
    return e.code() == grpc.StatusCode.INTERNAL and e.details() == "Internal error from Core"


class MoEClient(C.Connection):
    """An asyncio connection to one moed server; its calls may run concurrently as tasks.

    MoEClient(target, timeout=None, credentials=None, token=None, options=None, keepalive=None,
    retry=RetryPolicy(), transport="auto"): as moed.MoEClient, several daemons (a fleet) included.
    Use `async with`, or await close().
    """

    grpc_module = grpc.aio

    def __new__(cls, target: Any = "127.0.0.1:50051", *args, **kwargs):
        if cls is MoEClient and not (isinstance(target, str) and not target.startswith("dns:")):
            from .fleet import AioFleetClient, is_fleet

            if is_fleet(target):
                cls = AioFleetClient
        return super().__new__(cls)

    async def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> "MoEClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _unary(self, method, payload: bytes, timeout: Optional[float]) -> bytes:
        """One unary call with the retry policy; the reply's bytes."""
        deadline = self._deadline(timeout)
        attempt = 1
        while True:
            start = time.monotonic()
            try:
                return await method(payload, timeout=C.remaining(deadline), metadata=self._metadata)
            except grpc.RpcError as e:
                now = time.monotonic()
                wait = self.retry.delay(attempt, e.code(), now, deadline, now - start)
                if wait is None:
                    raise C.rpc_error(e, attempt) from None
            await asyncio.sleep(wait)
            attempt += 1

    async def forward(self, layer: int, hidden: Any, *, expert_ids=None, expert_weights=None,
                      router_logits=None, strategy=None, top_k: int = 0,
                      renormalize: Optional[bool] = None, threshold: Optional[float] = None,
                      batch_gating: bool = False, k_batch: int = 0, dtype: Optional[str] = None,
                      request_id: str = "", return_info: bool = False, copy: bool = False,
                      transport: Optional[str] = None, timeout: Optional[float] = None):
        """moed.MoEClient.forward, awaited: the output of the input's kind (or a ForwardResult)."""
        call = C.prepare_forward(layer, hidden, expert_ids=expert_ids, expert_weights=expert_weights,
                                 router_logits=router_logits, strategy=strategy, top_k=top_k,
                                 renormalize=renormalize, threshold=threshold,
                                 batch_gating=batch_gating, k_batch=k_batch, dtype=dtype,
                                 request_id=request_id, return_info=return_info, copy=copy,
                                 transport=transport or self.transport)
        return call.result(await self._unary(self._forward, call.payload, timeout))

    async def forward_stream(self, requests: Any, *, timeout: Optional[float] = None,
                             transport: Optional[str] = None) -> AsyncIterator[Any]:
        """moed.MoEClient.forward_stream as an async generator: `requests` is an async iterable
        (or a plain iterable) of dicts of forward()'s keyword arguments; yields the outputs in
        order. Use `async for y in c.forward_stream(requests)`."""
        source = requests.__aiter__() if hasattr(requests, "__aiter__") else iter(requests)
        feed = C.Feed(source, transport or self.transport)
        pull_lock = asyncio.Lock()
        deadline = self._deadline(timeout)
        failures = 0
        while True:
            call = self._stream(self._requests(feed, pull_lock), timeout=C.remaining(deadline),
                                metadata=self._metadata)
            try:
                async for reply in call:
                    failures = 0
                    yield feed.answer(reply)
                break
            except grpc.RpcError as e:
                oldest = feed.oldest() if _status_hidden(e) else None
                if oldest is None:
                    failures += 1
                    wait = self.retry.delay(failures, e.code(), time.monotonic(), deadline)
                    if wait is None:
                        raise C.rpc_error(e, failures) from None
            finally:
                call.cancel()  # a no-op once the stream ended; stops it if the caller stopped early
            if oldest is not None:
                # The stream's status is lost: the oldest unanswered request alone, as a unary
                # call, whose status is reliable, answers it (its output, or its error raised);
                # then a new stream goes on with the rest.
                failures = 0
                yield feed.answer(await self._unary(self._forward, oldest.payload, C.remaining(deadline)))
                continue
            await asyncio.sleep(wait)
        feed.end()

    @staticmethod
    async def _requests(feed: C.Feed, pull_lock: asyncio.Lock) -> AsyncIterator[bytes]:
        """The payloads of one attempt of a stream (grpc.aio iterates this in a task of its own)."""
        attempt, seq = feed.start()
        while True:
            payload = feed.payload(attempt, seq)
            if payload is None:
                async with pull_lock:  # one puller of the caller's iterable at a time
                    payload = feed.payload(attempt, seq)
                    if payload is None:
                        if feed.done:
                            return
                        try:
                            if hasattr(feed.source, "__anext__"):
                                item = await feed.source.__anext__()
                            else:
                                item = next(feed.source)
                        except (StopIteration, StopAsyncIteration):
                            feed.stop()
                            return
                        except Exception as e:  # the caller's iterable failed: raised in order
                            feed.stop(e)
                            return
                        payload = feed.pulled(item)
                        if payload is None:
                            return
            if payload is C.STALE:
                return
            yield payload
            seq += 1

    async def info(self, timeout: Optional[float] = None) -> ModelInfo:
        """moed.MoEClient.info, awaited."""
        return C.model_info(await self._unary(self._get_model, b"", timeout))

    async def health(self, service: str = "", timeout: Optional[float] = None) -> str:
        """moed.MoEClient.health, awaited."""
        return C.health_status(await self._unary(self._health, C.health_request(service), timeout))
