"""The request queue and the future store behind the Tinker API's futures.

Every backend call runs on one executor thread (`CallQueue`), in arrival order, so no two calls ever interleave on
the device. The HTTP handler that accepts a request queues its call and answers at once with a request id; the
client then long-polls `/api/v1/retrieve_future` (`FutureStore.wait`) for the call's payload: a JSON dict, protobuf
bytes, or a failure (`{"error": ..., "category": "user" | "server"}`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import Callable, Hashable
from typing import Any

from hfjax.serve.backend import ServeError

log = logging.getLogger(__name__)
PROGRESS_EVERY_S = 30.0  # a call running longer says so in the log this often

Payload = dict[str, Any] | bytes
"""What a finished future answers: a JSON object, or protobuf bytes (`ForwardBackwardOutput`, `SampleResponse`)."""


def failure(message: str, category: str = "user") -> dict[str, str]:
    """A failed future's payload, which the SDK raises as `RequestFailedError` with `message`."""
    return {"error": message, "category": category}


class CallQueue:
    """One thread that runs the backend calls in the order they were queued. Grouped calls (`submit_grouped`: the
    sampling requests of one sampler version) run together, in the place of the group's first request."""

    def __init__(self) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hfjax-serve-backend")
        self._groups: dict[Hashable, list[tuple[Any, concurrent.futures.Future]]] = {}
        self._lock = threading.Lock()

    def submit(self, method: str, model_id: str | None, call: Callable[[], Payload]) -> concurrent.futures.Future:
        """Queues `call`; its future always resolves to a payload: `ServeError` becomes a user failure, any other
        exception a server failure (logged with its traceback)."""
        return self._executor.submit(lambda: _run_logged(method, model_id, 1, call)[0])

    def submit_grouped(
        self, method: str, subject: str, group: Hashable, item: Any, call: Callable[[list[Any]], list[Payload]]
    ) -> concurrent.futures.Future:
        """Queues `item` in the open group `group`, or opens it (queuing one call for the group, logged as `method`
        of `subject`): when the group's call reaches the front of the queue it takes every item queued in the group
        by then, and `call(items)` answers one payload per item. The returned future is this item's; cancelling it
        before the call starts leaves the item out."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if group not in self._groups:
                self._groups[group] = []
                self._executor.submit(self._run_group, method, subject, group, call)
            self._groups[group].append((item, future))
        return future

    def _run_group(
        self, method: str, subject: str, group: Hashable, call: Callable[[list[Any]], list[Payload]]
    ) -> None:
        with self._lock:
            members = [
                (item, future) for item, future in self._groups.pop(group) if future.set_running_or_notify_cancel()
            ]
        if not members:
            return
        payloads = _run_logged(method, subject, len(members), lambda: call([item for item, _ in members]))
        for (_, future), payload in zip(members, payloads, strict=True):
            future.set_result(payload)

    def close(self) -> None:
        """Drops the calls not yet started and lets the running one finish (without waiting for it)."""
        with self._lock:
            for members in self._groups.values():
                for _, future in members:
                    future.cancel()
            self._groups.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)


def _run_logged(method: str, subject: Any, count: int, call: Callable[[], Any]) -> list[Payload]:
    """`call()`'s payloads (`count` of them: one, or a list for a group), a failure for each when it raises; logs
    the call with its duration."""
    start = time.perf_counter()
    done = threading.Event()
    threading.Thread(target=_report_while_running, args=(method, subject, start, done), daemon=True).start()
    try:
        out = call()
        payloads = out if isinstance(out, list) else [out]
        if len(payloads) != count:
            raise RuntimeError(f"{len(payloads)} results for {count} requests")
    except ServeError as error:
        payloads = [failure(str(error))] * count
    except Exception as error:
        log.exception("%s for %s failed", method, subject)
        payloads = [failure(f"internal server error in {method}: {type(error).__name__}: {error}", "server")] * count
    done.set()
    failed = sum(isinstance(p, dict) and "error" in p for p in payloads)
    batch = f" x{count}" if count > 1 else ""
    outcome = f" ({failed} failed)" if failed else ""
    log.info("%s %s%s %.3f s%s", method, subject, batch, time.perf_counter() - start, outcome)
    return payloads


def _report_while_running(method: str, subject: Any, start: float, done: threading.Event) -> None:
    """Logs every `PROGRESS_EVERY_S` that the call is still running, until `done`."""
    while not done.wait(PROGRESS_EVERY_S):
        log.info("%s %s still running after %.0f s", method, subject, time.perf_counter() - start)


class FutureStore:
    """Request id -> queued call. A `dedup_key` (model or sampler, seq id) makes a retried submission return the
    first one's request id instead of running twice. A finished entry is dropped `kept_after_read_s` after it was
    first read (a client re-reads only when a response was lost) or `kept_unread_s` after it finished."""

    def __init__(self, kept_after_read_s: float = 60.0, kept_unread_s: float = 1800.0) -> None:
        self._futures: dict[str, tuple[concurrent.futures.Future, Any]] = {}
        self._by_key: dict[Any, str] = {}
        self._expires: dict[str, float] = {}  # finished entries: when they are dropped
        self._kept_after_read_s, self._kept_unread_s = kept_after_read_s, kept_unread_s
        self._lock = threading.Lock()

    def existing(self, dedup_key: Any) -> str | None:
        """The request id already submitted under `dedup_key`, if any."""
        with self._lock:
            return self._by_key.get(dedup_key)

    def add(self, future: concurrent.futures.Future, dedup_key: Any = None) -> str:
        request_id = uuid.uuid4().hex
        with self._lock:
            self._drop_expired()
            self._futures[request_id] = (future, dedup_key)
            if dedup_key is not None:
                self._by_key[dedup_key] = request_id
        future.add_done_callback(lambda _: self._expire_in(request_id, self._kept_unread_s))
        return request_id

    def cancel(self, request_id: str) -> bool:
        """Cancels a call that has not started; True if it will not run."""
        with self._lock:
            entry = self._futures.get(request_id)
        return entry is not None and entry[0].cancel()

    async def wait(self, request_id: str, timeout_s: float) -> Payload | None:
        """The request's payload, waiting up to `timeout_s` (None: not done yet). KeyError: unknown request id."""
        with self._lock:
            future, _ = self._futures[request_id]
        if not future.done():
            await asyncio.wait([asyncio.wrap_future(future)], timeout=timeout_s)
            if not future.done():
                return None
        self._expire_in(request_id, self._kept_after_read_s)
        if future.cancelled():
            return failure("the request was cancelled")
        return future.result()

    def _expire_in(self, request_id: str, seconds: float) -> None:
        with self._lock:
            if request_id in self._futures:
                at = time.monotonic() + seconds
                self._expires[request_id] = min(at, self._expires.get(request_id, at))

    def _drop_expired(self) -> None:
        now = time.monotonic()
        for request_id in [rid for rid, at in self._expires.items() if at < now]:
            _, dedup_key = self._futures.pop(request_id)
            del self._expires[request_id]
            if dedup_key is not None and self._by_key.get(dedup_key) == request_id:
                del self._by_key[dedup_key]
