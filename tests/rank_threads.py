"""One thread per rank, for tests whose ranks live in one process (CPU stand-ins, a loopback
group's host-side reference): shared by tests/test_torch_cpu.py, tests/test_torch_sized_cpu.py
and tests/gpu/test_moe.py."""

from __future__ import annotations

import threading
from collections.abc import Callable


def on_threads(world: int, body: Callable[[int], object], wake: Callable[[], None], timeout: float = 60) -> list:
    """``body(r)`` for every rank r on its own thread; returns the results in rank order.  The
    first error is raised once every thread has ended: ``wake()`` runs on an error, to free the
    ranks left waiting for the failed one (a barrier left waiting would hang the test), and a
    thread still running after ``timeout`` seconds fails the test."""
    results, errors = [None] * world, []

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as error:  # noqa: BLE001 - raised below
            errors.append(error)
            wake()
    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results
