"""A host-side bound on the ``ce`` atom's stream waits.

The copy engines have no clock: ``cuStreamWaitValue64`` waits until the value arrives, so a
peer that never calls would leave the stream (and anything queued behind it) blocked for
ever.  The watchdog bounds that from the host.  Every ce call records an event after its
last operation; one daemon thread per process polls the oldest unfinished call of each
runner.  A call's clock starts when it is enqueued or when the call before it was seen
finished, whichever is later, so a host that queues many calls ahead is not mistaken for a
stuck one.  When a call runs past the bound, the watchdog

1. releases the stuck streams: it writes every value that call waits for into its signal
   word, on a stream of its own (a stream memory operation, which needs no copy engine and
   does not queue behind the blocked streams), so the GPU drains instead of hanging;
2. writes the collective's error record (the same host-mapped words the ``ldst``/``tma``
   kernels write on a timeout), so the next call, or ``check()``, raises
   ``PurlinTimeoutError`` naming the rank, channel, signal, expected value and the bound.

The data of that call is not valid, and the collective's signals are out of step with its
peers: like any timeout, the collective refuses further calls (load it again).

Calls captured into a CUDA graph are not watched (a replay is not a call the host sees).
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from purlinc.atom.abi import ERROR_RECORD

POLL_S = 0.02  # how often the thread looks; the bound is seconds, so this costs nothing


@dataclass
class _Call:
    event: object
    waits: tuple[tuple[int, int, int, int], ...]  # (channel, op index, address, value)
    enqueued: float
    started: float | None = None  # when it became the oldest unfinished call


@dataclass
class _Watched:
    device: int
    timeout_s: float
    on_timeout: Callable[[tuple, float], None]
    calls: deque = field(default_factory=deque)
    fired: bool = False


class Watchdog:
    """Watches ce calls of any number of runners; one per process (``watchdog()``).

    ``ops`` holds the driver calls it uses (``event_create``, ``event_record``,
    ``event_done``, ``event_destroy``, ``is_capturing``, ``stream_create``,
    ``write_value64``, ``set_current``): tests pass fakes, the runtime the real driver.
    """

    def __init__(self, ops, poll_s: float = POLL_S, clock: Callable[[], float] = time.monotonic):
        self.ops = ops
        self.poll_s = poll_s
        self.clock = clock
        # One lock over the watched calls and their events: the thread queries and destroys
        # events while the runner's close() destroys the rest (a double cuEventDestroy, or a
        # query of a destroyed event, crashed a process on 2 x H200).
        self._lock = threading.RLock()
        self._watched: dict[int, _Watched] = {}
        self._release_streams: dict[int, object] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # ---------------------------------------------------------------- called by the runner
    def register(self, key: int, device: int, timeout_s: float, on_timeout: Callable[[tuple, float], None]) -> None:
        """Watch runner ``key``; ``on_timeout(waits, seconds)`` is called once, from the thread."""
        with self._lock:
            self._watched[key] = _Watched(device, timeout_s, on_timeout)

    def unregister(self, key: int) -> None:
        with self._lock:
            watched = self._watched.pop(key, None)
            if watched is not None:
                for call in watched.calls:
                    self.ops.event_destroy(call.event)
                watched.calls.clear()

    def track(self, key: int, stream, waits) -> None:
        """After a call's operations were enqueued on ``stream`` (the caller's, after the join):
        watch it until it finishes.  ``waits``: (channel, op index, address, value) per wait."""
        watched = self._watched.get(key)
        if watched is None or watched.fired or self.ops.is_capturing(stream):
            return
        event = self.ops.event_create()
        self.ops.event_record(event, stream)
        with self._lock:
            watched.calls.append(_Call(event, tuple(waits), self.clock()))
        self._ensure_thread()

    # ---------------------------------------------------------------- the thread
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="purlin-ce-watchdog", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        # The thread queries events while other threads may be capturing CUDA graphs; under the
        # default (global) capture mode such a query from any thread invalidates their capture.
        # Relaxed mode exempts this thread; it only queries events recorded outside any capture.
        relax = getattr(self.ops, "relax_capture_mode", None)
        if relax is not None:
            relax()
        while not self._stop.wait(self.poll_s):
            self.poll()

    def stop(self) -> None:
        self._stop.set()

    def poll(self) -> None:
        """One look at every runner's oldest unfinished calls (the thread calls this)."""
        with self._lock:
            for key, watched in list(self._watched.items()):
                if not watched.calls:
                    continue
                self.ops.set_current(watched.device)  # this thread's context, for the event calls
                now = self.clock()
                while watched.calls:
                    call = watched.calls[0]
                    if call.started is None:
                        call.started = max(call.enqueued, now)
                    if self.ops.event_done(call.event):
                        watched.calls.popleft()
                        self.ops.event_destroy(call.event)
                        continue
                    if now - call.started > watched.timeout_s and not watched.fired:
                        watched.fired = True
                        self._fire(watched, call, now - call.started)
                    break

    def _fire(self, watched: _Watched, call: _Call, waited: float) -> None:
        ops = self.ops
        ops.set_current(watched.device)
        stream = self._release_streams.get(watched.device)
        if stream is None:
            stream = self._release_streams[watched.device] = ops.stream_create()
        # Reading the signal words to find the stuck wait would need a copy that may queue
        # behind the blocked streams; the report names the call's waits instead.
        for _, _, address, value in call.waits:
            ops.write_value64(stream, address, value)  # unblocks the copy engines' waits
        watched.on_timeout(call.waits, waited)


def write_error_record(host_address: int, rank: int, channel: int, step: int, owner: int, index: int,
                       expected: int, observed: int) -> None:
    """Fill a collective's host-mapped error record as a timed-out kernel would; the flag last."""
    words = (ctypes.c_uint64 * len(ERROR_RECORD)).from_address(host_address)
    values = {"rank": rank, "channel": channel, "step": step, "signal_owner": owner, "signal_index": index,
              "expected": expected, "observed": observed}
    for position, name in enumerate(ERROR_RECORD):
        if name != "flag":
            words[position] = values[name]
    words[0] = 1


class DriverOps:
    """The real driver calls the watchdog makes."""

    def __init__(self):
        from purlinc.runtime import driver

        self.d = driver
        from cuda.bindings import driver as cu

        self.cu = cu

    def event_create(self):
        return self.d.event_create()

    def event_record(self, event, stream) -> None:
        self.d.event_record(event, stream)

    def event_destroy(self, event) -> None:
        try:
            self.d.event_destroy(event)
        except Exception:  # noqa: BLE001 - a context already torn down at exit
            pass

    def event_done(self, event) -> bool:
        result = self.cu.cuEventQuery(event)
        result = result[0] if isinstance(result, tuple) else result
        return result == self.cu.CUresult.CUDA_SUCCESS  # NOT_READY (or an error): not finished

    def relax_capture_mode(self) -> None:
        mode = self.cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        self.d.call(self.cu.cuThreadExchangeStreamCaptureMode, mode)

    def is_capturing(self, stream) -> bool:
        status = self.d.call(self.cu.cuStreamIsCapturing, stream)
        return status != self.cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE

    def stream_create(self):
        return self.d.stream_create()

    def write_value64(self, stream, address: int, value: int) -> None:
        self.d.write_value64(stream, address, value)

    def set_current(self, device: int) -> None:
        self.d.set_current(device)


_WATCHDOG: Watchdog | None = None
_WATCHDOG_LOCK = threading.Lock()


def watchdog() -> Watchdog:
    """The process's watchdog (created on first use)."""
    global _WATCHDOG
    with _WATCHDOG_LOCK:
        if _WATCHDOG is None:
            _WATCHDOG = Watchdog(DriverOps())
        return _WATCHDOG
