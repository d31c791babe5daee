"""moed.aio.FleetClient: the asyncio client of several daemons (moed.fleet says what a fleet does),
on one moed.aio.MoEClient per daemon; the shards of a call run as tasks."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, List, Optional, Sequence, Tuple

import grpc

from . import _common as C
from . import fleet_plan as P
from .aio_client import MoEClient
from .fleet import FleetBase, Replan, probe_wait, stream_items
from .interface import AioClient
from .regions import Registration
from .retry import RetryPolicy
from .types import ModelInfo, MoEError, Region


class FleetClient(FleetBase, AioClient):
    """moed.FleetClient, awaited; moed.aio.connect(targets) makes one, in the running event loop."""

    def __init__(self, target: Any = "127.0.0.1:50051", timeout: Optional[float] = None,
                 credentials: Optional[grpc.ChannelCredentials] = None, token: Optional[str] = None,
                 options: Optional[Sequence[Tuple[str, Any]]] = None, keepalive: Optional[float] = None,
                 retry: Optional[RetryPolicy] = RetryPolicy(), transport: str = "auto"):
        super().__init__(MoEClient, target, timeout, credentials, token, options, keepalive, retry,
                         transport)

    async def close(self) -> None:
        for m in self.fleet.members:
            await m.client.close()

    async def _regroup(self) -> bool:
        if not self._names.due(time.monotonic()):
            return False
        addresses = await asyncio.get_running_loop().run_in_executor(None, self._names.addresses)
        return self.fleet.regroup(addresses, self._make)

    # -- learning the fleet --

    def _start(self, m: P.Member) -> asyncio.Future:
        """m's probe (the fleet's to_probe and to_check make it under their lock): a task that
        records its answer when it comes."""
        return asyncio.ensure_future(self._ask(m))

    async def _ask(self, m: P.Member) -> None:
        """One probe: m's GetModel, recorded when it comes (the task is the probe)."""
        me = asyncio.current_task()  # the fleet recorded it as m's probe before it first runs
        try:
            reply = await m.client._get_model(b"", timeout=P.PROBE_TIMEOUT, metadata=m.client._metadata)
            self.fleet.probed(m, me, C.model_info(reply), "", time.monotonic())
        except grpc.RpcError as e:
            self.fleet.probed(m, me, None, f"{e.code().name}: {e.details()}", time.monotonic())
        except MoEError as e:
            self.fleet.probed(m, me, None, str(e), time.monotonic())
        except asyncio.CancelledError:
            self.fleet.probed(m, me, None, "GetModel cancelled", time.monotonic())
            raise

    async def _learn(self, members: Sequence[P.Member], deadline: Optional[float]) -> None:
        probes = [f for _, f in self.fleet.to_probe(members, time.monotonic(), self._start)]
        probes += [f for m in members for f in [m.probe] if f is not None and f not in probes]
        if probes:
            await asyncio.wait(probes, timeout=probe_wait(deadline))

    async def _shards(self, layer: int, deadline: Optional[float]) -> List[P.Shard]:
        self.fleet.to_probe(self.fleet.members, time.monotonic(), self._start)
        if self.fleet.unsettled():
            await self._learn(self.fleet.members, deadline)
        shards, err = self._try_plan(layer)
        if err is not None:
            await self._regroup()
            await self._learn(self.fleet.members, deadline)
            shards, err = self.fleet.plan(layer, time.monotonic())
        if err is not None:
            raise err
        return shards

    # -- calls --

    async def _begin(self, t: P.Attempts, deadline: Optional[float]) -> bool:
        while True:
            now = time.monotonic()
            m = self.fleet.pick(t.shard, t.tried, now)
            if m is not None:
                break
            probes = [f for _, f in self.fleet.to_check(t.shard, t.tried, now, self._start)]
            if not probes:
                return False
            await asyncio.wait(probes, timeout=probe_wait(deadline))
        t.member, t.started = m, now
        t.attempt = asyncio.ensure_future(
            m.client._forward(t.payload, timeout=C.remaining(deadline), metadata=m.client._metadata))
        return True

    async def _finish(self, t: P.Attempts, deadline: Optional[float]) -> bytes:
        while True:
            if t.attempt is not None:
                try:
                    reply = await t.attempt
                    self.fleet.done(t.member, None, "", time.monotonic())
                    return reply
                except grpc.RpcError as e:
                    if not t.failed(self.fleet, e.code(), e.details(), time.monotonic()):
                        raise C.rpc_error(e) from None
            if await self._begin(t, deadline):
                continue
            if await self._regroup():
                raise Replan()
            await asyncio.sleep(t.next_round(self.retry, deadline, time.monotonic()))
            self.fleet.revive(t.shard, time.monotonic())

    async def forward(self, layer: int, hidden: Any, *, expert_ids=None, expert_weights=None,
                      router_logits=None, strategy=None, top_k: int = 0,
                      renormalize: Optional[bool] = None, threshold: Optional[float] = None,
                      batch_gating: bool = False, k_batch: int = 0, dtype: Optional[str] = None,
                      request_id: str = "", return_info: bool = False, copy: bool = False,
                      transport: Optional[str] = None, out: Any = None,
                      timeout: Optional[float] = None):
        """moed.aio.MoEClient.forward over the fleet."""
        call = self._prepare(layer, hidden, transport, expert_ids=expert_ids, expert_weights=expert_weights,
                             router_logits=router_logits, strategy=strategy, top_k=top_k,
                             renormalize=renormalize, threshold=threshold, batch_gating=batch_gating,
                             k_batch=k_batch, dtype=dtype, request_id=request_id,
                             return_info=return_info, copy=copy, out=out)
        deadline = self._deadline(timeout)
        try:
            return await self._fan_out(layer, call, batch_gating, deadline)
        except Replan:  # the fleet changed under the call: once more on its new plan
            return await self._fan_out(layer, call, batch_gating, deadline)

    async def _fan_out(self, layer: int, call: C.Call, batch_gating: bool,
                       deadline: Optional[float]) -> Any:
        shards = await self._shards(layer, deadline)
        P.check_batch_gating(layer, shards, batch_gating)
        parts = P.requests(call, shards)
        tries = [P.Attempts(s, payload) for s, _, payload in parts]
        try:
            for t in tries:
                await self._begin(t, deadline)
            replies = await asyncio.gather(*(self._finish(t, deadline) for t in tries))
            return P.combine(call, len(shards), [(rows, r) for (_, rows, _), r in zip(parts, replies)])
        except BaseException:
            for t in tries:
                if t.attempt is not None:
                    t.attempt.cancel()
            raise

    async def forward_stream(self, requests: Any, *, timeout: Optional[float] = None,
                             transport: Optional[str] = None) -> AsyncIterator[Any]:
        """moed.aio.MoEClient.forward_stream over the fleet: each request as forward() sends it."""
        deadline = self._deadline(timeout)
        if hasattr(requests, "__aiter__"):
            async for item in requests:
                C.check_item(item)
                yield await self.forward(**{"transport": transport, **item, "timeout": C.remaining(deadline)})
        else:
            for item in stream_items(requests):
                yield await self.forward(**{"transport": transport, **item, "timeout": C.remaining(deadline)})

    async def info(self, timeout: Optional[float] = None) -> ModelInfo:
        await self._learn(self.fleet.members, self._deadline(timeout))
        return P.merged_info(self.fleet.members)

    async def members(self, timeout: Optional[float] = None) -> List[P.FleetMember]:
        await self._learn(self.fleet.members, self._deadline(timeout))
        return self._members()

    async def health(self, service: str = "", timeout: Optional[float] = None) -> str:
        deadline = self._deadline(timeout)
        await self._learn(self.fleet.members, deadline)

        async def one(m: P.Member) -> str:
            try:
                return C.health_status(await m.client._health(
                    C.health_request(service), timeout=probe_wait(deadline), metadata=m.client._metadata))
            except (grpc.RpcError, MoEError):
                return "UNKNOWN"

        found = await asyncio.gather(*(one(m) for m in self.fleet.members))
        return P.serving(self.fleet, {m.target: st for m, st in zip(self.fleet.members, found)},
                         time.monotonic())

    async def register(self, tensor: Any) -> Registration:
        raise P.needs_one_daemon("register()")

    async def unregister(self, registration: Registration) -> None:
        raise P.needs_one_daemon("unregister()")

    async def regions(self, timeout: Optional[float] = None) -> List[Region]:
        raise P.no_listing()
