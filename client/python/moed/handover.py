"""The blocking forward_stream()'s threads (moed.client). gRPC pulls the caller's requests on a
thread of its own, as the stream can send them (so a generator may wait for the outputs before
it); but each item is prepared on the thread iterating the stream, as forward() prepares its call
on the caller's thread: its tensors are read there, a CUDA tensor after the work queued on that
thread's current stream (gRPC's thread has the default stream, so it could read a tensor that a
side stream has not written yet). The iterating thread therefore waits for two things at once: an
item handed over to prepare, and the next reply, which a thread of its own reads. A Desk is where
they meet.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator

_ITEM, _REPLY = object(), object()  # what comes to the desk
_END = object()  # a stream's end, OK


class Desk:
    """Items handed over by gRPC's request thread (hand_over, which waits for the item's Call)
    and the replies of each attempt of the stream, both served on the iterating thread
    (replies). close() releases a hand-over that waits when the iteration ends."""

    def __init__(self, prepare: Callable[[Any], Any]):
        self._prepare = prepare  # item -> its Call, run on the iterating thread
        self._inbox: "queue.SimpleQueue" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False

    def hand_over(self, item: Any) -> Any:
        """On gRPC's request thread: the Call of `item`, prepared on the iterating thread (what
        preparing it raised is raised here); None once the iteration has ended."""
        box: "queue.SimpleQueue" = queue.SimpleQueue()
        with self._lock:
            if self._closed:
                return None
            self._inbox.put((_ITEM, box, item))
        call, error = box.get()
        if error is not None:
            raise error
        return call

    def replies(self, call: Any) -> Iterator[bytes]:
        """On the iterating thread: the replies of `call` (one attempt of the stream), items handed
        over meanwhile prepared as they come; its failure (a grpc.RpcError) raised as gRPC raised
        it."""
        attempt = object()
        threading.Thread(target=self._read, args=(call, attempt), daemon=True, name="moed-stream").start()
        while True:
            kind, key, value = self._inbox.get()
            if kind is _ITEM:
                self._serve(key, value)
            elif key is attempt:
                if value is _END:
                    return
                if isinstance(value, BaseException):
                    raise value
                yield value
            # else what an earlier attempt's reader read after that attempt was given up

    def _read(self, call: Any, attempt: object) -> None:
        try:
            for reply in call:
                self._inbox.put((_REPLY, attempt, reply))
            self._inbox.put((_REPLY, attempt, _END))
        except BaseException as e:  # noqa: B902: the stream's failure (an RpcError), raised there
            self._inbox.put((_REPLY, attempt, e))

    def _serve(self, box: "queue.SimpleQueue", item: Any) -> None:
        try:
            box.put((self._prepare(item), None))
        except Exception as e:  # a bad item: raised on the request thread, in order
            box.put((None, e))
        except BaseException:  # the iterating thread is interrupted: the request thread stops
            box.put((None, None))
            raise

    def close(self) -> None:
        """The iteration ended: a hand-over waiting now, or made later, gets None."""
        with self._lock:
            self._closed = True
        while True:
            try:
                kind, key, _ = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind is _ITEM:
                key.put((None, None))
