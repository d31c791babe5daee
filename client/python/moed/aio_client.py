"""moed.aio.MoEClient: the asyncio client of one moed server, on grpc.aio, with the blocking
client's methods (moed.aio.FleetClient is the asyncio client of several, behind the same interface,
moed.interface.AioClient).

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
from typing import Any, AsyncIterator, List, Optional

import grpc
import grpc.aio

from . import _common as C
from .interface import AioClient
from .regions import LIMITS, LISTING, Registration, Steps
from .targets import single
from .types import ModelInfo, MoEError, Region


class Session(C.SessionBase):
    """The asyncio client's region session: the Regions stream written and read by the task that
    runs a command, one command and its event at a time."""

    def __init__(self, conn: "MoEClient"):
        super().__init__(conn)
        self._lock: Optional[asyncio.Lock] = None  # made in the client's loop, on first use
        self._limits_lock: Optional[asyncio.Lock] = None

    async def run(self, steps: Steps) -> Any:
        """Runs steps to their end; their value."""
        self.check()
        answer, error = None, None
        while True:
            try:
                op = steps.send(answer) if error is None else steps.throw(error)
            except StopIteration as stop:
                return stop.value
            answer, error = None, None
            try:
                answer = await (self._limits() if op is LIMITS else self.conn.regions() if op is LISTING
                                else self._command(op))
            except MoEError as e:
                error = e

    async def _limits(self) -> Any:
        self._limits_lock = self._limits_lock or asyncio.Lock()
        async with self._limits_lock:
            if self.regions.limits is None:
                self.regions.limits = (await self.conn.info()).regions
            return self.regions.limits

    async def _command(self, cmd: dict) -> dict:
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            if not self.alive():
                self.opened(self.stub()(metadata=self.conn._metadata))
            try:
                await self.call.write(self.command(cmd))
                data = await asyncio.wait_for(self.call.read(), self.timeout)
            except asyncio.TimeoutError:
                raise self.timed_out() from None
            except grpc.RpcError as e:
                raise self.ended(e) from None
            except asyncio.InvalidStateError:  # written after the stream ended
                data = grpc.aio.EOF
            if data is grpc.aio.EOF:
                code = await self.call.code()
                raise MoEError(code.name, f"the region session ended: {await self.call.details()}", code)
            return self.event(data)

    async def close(self) -> None:
        """Ends the stream (waiting a little for the server's end of it) and lets go of everything."""
        if self.alive():
            try:
                await self.call.done_writing()
                await asyncio.wait_for(self.call.code(), 5)
            except (grpc.RpcError, asyncio.TimeoutError, asyncio.InvalidStateError):
                self.call.cancel()
        self.closing()
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None


def _status_hidden(e: grpc.RpcError) -> bool:
    """Whether grpc.aio replaced a stream's status by its own INTERNAL: it does when a request
    write races the server's end of the stream (a fault of grpc.aio's own), so a stream the server
    ended with UNAVAILABLE or NOT_FOUND may report "Internal error from Core" instead."""
    return e.code() == grpc.StatusCode.INTERNAL and e.details() == "Internal error from Core"


class MoEClient(C.Connection, AioClient):
    """An asyncio connection to one moed server; its calls may run concurrently as tasks.

    MoEClient(target, timeout=None, credentials=None, token=None, options=None, keepalive=None,
    retry=RetryPolicy(), transport="auto"): as moed.MoEClient (one daemon: moed.aio.connect makes
    a fleet client of several). Use `async with`, or await close().
    """

    grpc_module = grpc.aio

    def __init__(self, target: str = "127.0.0.1:50051", *args, **kwargs):
        super().__init__(single(target, "moed.aio.MoEClient", "moed.aio.connect"), *args, **kwargs)
        self._session = Session(self)

    async def close(self) -> None:
        """Ends the region session and closes the channel, as moed.MoEClient.close."""
        await self._session.close()
        await self._channel.close()

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
                      transport: Optional[str] = None, out: Any = None,
                      timeout: Optional[float] = None):
        """moed.MoEClient.forward, awaited: the output of the input's kind (or a ForwardResult)."""
        for again in (False, True):
            call = await self._session.run(C.prepare_forward(
                layer, hidden, expert_ids=expert_ids, expert_weights=expert_weights,
                router_logits=router_logits, strategy=strategy, top_k=top_k, renormalize=renormalize,
                threshold=threshold, batch_gating=batch_gating, k_batch=k_batch, dtype=dtype,
                request_id=request_id, return_info=return_info, copy=copy,
                transport=transport or self.transport, out=out, regions=self._session.regions))
            C.count(self, call.transport)
            try:
                reply = await self._unary(self._forward, call.payload, timeout)
            except (MoEError, asyncio.CancelledError) as e:
                call.failed(e.code_name if isinstance(e, MoEError) else "CANCELLED")
                if again or not isinstance(e, MoEError) or not call.regions or self._session.alive():
                    raise
                continue
            return call.result(reply)

    async def register(self, tensor: Any) -> Registration:
        """moed.MoEClient.register, awaited."""
        return await self._session.run(self._session.regions.register(tensor))

    async def unregister(self, registration: Registration) -> None:
        """moed.MoEClient.unregister, awaited."""
        await self._session.run(self._session.regions.unregister(registration))

    async def regions(self, timeout: Optional[float] = None) -> List[Region]:
        """moed.MoEClient.regions, awaited."""
        return C.region_list(await self._unary(self._list_regions, b"", timeout))

    async def forward_stream(self, requests: Any, *, timeout: Optional[float] = None,
                             transport: Optional[str] = None) -> AsyncIterator[Any]:
        """moed.MoEClient.forward_stream as an async generator: `requests` is an async iterable
        (or a plain iterable) of dicts of forward()'s keyword arguments; yields the outputs in
        order. Use `async for y in c.forward_stream(requests)`."""
        source = requests.__aiter__() if hasattr(requests, "__aiter__") else C.requests_of(requests)
        feed = C.Feed(source, transport or self.transport, self._session.regions)
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
                        feed.abandon(e.code().name)
                        raise C.rpc_error(e, failures) from None
            except (GeneratorExit, asyncio.CancelledError):
                feed.abandon("CANCELLED")
                raise
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

    async def _requests(self, feed: C.Feed, pull_lock: asyncio.Lock) -> AsyncIterator[bytes]:
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
                        try:
                            call = await self._session.run(feed.steps(item))
                        except Exception as e:  # a bad item: raised in order
                            feed.stop(e)
                            return
                        C.count(self, call.transport)
                        payload = feed.pulled(call)
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
