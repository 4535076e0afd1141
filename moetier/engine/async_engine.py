"""AsyncEngine: an :class:`Engine` stepped by a background thread, bridged to asyncio.

The engine is not thread-safe, so only the background thread touches it. Callers validate a
request against the engine's immutable limits in their own thread (so a bad request raises in
``generate`` at once), then hand it over through an inbox; aborts go the same way. Updates come
back through ``loop.call_soon_threadsafe`` into one ``asyncio.Queue`` per request.

Robustness contract:
- a consumer that stops iterating (breaks out, closes the async generator, is cancelled) aborts
  its request; the engine frees its cache within one step;
- a request whose processing raises ends with ``finish_reason "abort"`` and ``error`` (the
  engine isolates it); should ``Engine.step`` itself raise, the requests in flight are failed that
  way and the thread carries on. The thread never dies of an exception.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from moetier.engine.engine import Engine, EngineBusyError, EngineStats, RequestUpdate
from moetier.engine.sampling import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Stream:
    """One ``generate`` call: where its updates go, and the id the engine knows it by.

    The engine id is unique per call, so a stale update of an aborted request can never reach a
    later request that reuses the same id.
    """

    request_id: str
    engine_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    """Owns a background thread that steps ``engine`` while it has work, and sleeps otherwise."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()  # guards everything below but the engine itself
        self._inbox: list[Callable[[], None]] = []
        self._active: dict[str, _Stream] = {}  # by caller's request id
        self._streams: dict[str, _Stream] = {}  # by engine id
        self._calls = 0
        self._pending_adds = 0
        self._stats = engine.stats()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="moetier-engine", daemon=True)
        self._thread.start()

    # --- caller side (any thread; generate() on an event loop) ---------------------------------------

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestUpdate]:
        """Yield the request's updates as they come; the last has ``finished=True``.

        Raises (on the first iteration) ``ValueError`` for an id in flight, :class:`ConfigError` for an
        invalid request, :class:`EngineBusyError` when the queue is full, ``RuntimeError`` after shutdown.
        """
        stream = self._submit(request_id, prompt_ids, params, asyncio.get_running_loop())
        finished = False
        try:
            while True:
                update: RequestUpdate = await stream.queue.get()
                finished = update.finished
                yield update
                if finished:
                    return
        finally:
            self._forget(stream)
            if not finished:  # the consumer left early (break, aclose, cancellation): stop the work
                self._enqueue(lambda: self.engine.abort(stream.engine_id))

    def _submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, loop) -> _Stream:
        ids = self.engine.validate_request(prompt_ids, params)  # reads only immutable limits
        with self._lock:
            if self._stopping:
                raise RuntimeError("the engine is shut down")
            if request_id in self._active:
                raise ValueError(f"request id {request_id!r} is already in flight")
            waiting = self._stats.waiting + self._pending_adds
            if waiting >= self.engine.config.max_waiting:
                raise EngineBusyError(f"{waiting} requests are already waiting; retry later")
            self._calls += 1
            stream = _Stream(request_id, f"{request_id}#{self._calls}", loop, asyncio.Queue())
            self._active[request_id] = self._streams[stream.engine_id] = stream
            self._pending_adds += 1
            self._inbox.append(lambda: self._add(stream, ids, params))
        self._wake.set()
        return stream

    def _forget(self, stream: _Stream) -> None:
        with self._lock:
            self._streams.pop(stream.engine_id, None)
            if self._active.get(stream.request_id) is stream:
                del self._active[stream.request_id]

    def _enqueue(self, work: Callable[[], None]) -> None:
        with self._lock:
            self._inbox.append(work)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if unknown or finished); its cache is freed within one step and its
        consumer receives a final ``"abort"`` update."""
        with self._lock:
            stream = self._active.get(request_id)
        if stream is not None:
            self._enqueue(lambda: self.engine.abort(stream.engine_id))

    def stats(self) -> EngineStats:
        """The engine's stats as of its last step (requests submitted since then count as waiting)."""
        with self._lock:
            stats = EngineStats(**vars(self._stats))
            stats.waiting += self._pending_adds
        return stats

    def prefill_progress(self, request_id: str) -> tuple[int, int] | None:
        """(prompt tokens prefilled, prompt tokens) of a running request still prefilling, as of the last
        step; None when it waits, decodes or is unknown."""
        with self._lock:
            stream = self._active.get(request_id)
            return None if stream is None else self._stats.prefill_progress.get(stream.engine_id)

    async def shutdown(self) -> None:
        """Stop the thread; requests still in flight are aborted and end with an ``"abort"`` update."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        with self._lock:
            streams = list(self._streams.values())
            self._streams, self._active = {}, {}
        # The thread is gone: this thread may touch the engine now. Free everything it still holds.
        for engine_id in self.engine.request_ids():
            self.engine.abort(engine_id)
        self.engine.step()  # delivers (to nobody) the abort notices just queued
        for stream in streams:
            self._push(stream, RequestUpdate(stream.request_id, [], "", True, "abort", error="the engine shut down"))

    # --- engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.clear()
            self._apply_inbox()
            if self._stopping:
                return
            if not self.engine.has_work():
                # Idle: sleep until new work, or until a spare cache has waited long enough to be dropped.
                self._wake.wait(self.engine.expire_spares())
                continue
            try:
                updates = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - a bug in the engine must not kill the thread
                logger.exception("engine step failed; failing the requests in flight")
                updates = self._fail_all(exc)
            self._publish(updates)

    def _apply_inbox(self) -> None:
        with self._lock:
            work, self._inbox = self._inbox, []
        for item in work:
            try:
                item()
            except Exception:  # noqa: BLE001 - never let one request's handling stop the thread
                logger.exception("engine request handling failed")
        with self._lock:
            self._stats = self.engine.stats()

    def _add(self, stream: _Stream, ids: list[int], params: SamplingParams) -> None:
        with self._lock:
            self._pending_adds -= 1
            if stream.engine_id not in self._streams:
                return  # the consumer left before the request reached the engine
        try:
            self.engine.add_request(stream.engine_id, ids, params)
        except Exception as exc:  # noqa: BLE001 - e.g. the queue filled up meanwhile: tell the consumer
            self._publish([RequestUpdate(stream.engine_id, [], "", True, "abort", None, len(ids), error=str(exc))])

    def _fail_all(self, exc: BaseException) -> list[RequestUpdate]:
        """Abort everything the engine holds; the streams get a final update carrying the error."""
        updates = []
        for engine_id in self.engine.request_ids():
            self.engine.abort(engine_id)
            updates.append(RequestUpdate(engine_id, [], "", True, "abort", error=f"{type(exc).__name__}: {exc}"))
        # The engine's own abort notices follow with the next step; their streams are gone by then.
        return updates

    def _publish(self, updates: list[RequestUpdate]) -> None:
        """Route engine updates (keyed by engine id) to their streams, under the caller's request id."""
        with self._lock:
            self._stats = self.engine.stats()
            targets = []
            for update in updates:
                stream = self._streams.get(update.request_id)
                if stream is not None:
                    if update.finished:
                        del self._streams[update.request_id]
                    targets.append((stream, update))
        for stream, update in targets:
            update.request_id = stream.request_id
            if not self._push(stream, update):
                self.engine.abort(stream.engine_id)  # its event loop is closed: nobody will read

    @staticmethod
    def _push(stream: _Stream, update: RequestUpdate) -> bool:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, update)
        except RuntimeError:  # the loop is closed
            return False
        return True
