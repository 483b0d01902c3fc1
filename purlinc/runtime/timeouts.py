"""A rank's error record: where a device-side wait that ran past its bound says so (read
without a sync), and the PurlinTimeoutError it becomes.

``Timeouts`` is a part of ``Collective`` (runtime/collective.py), kept apart because it is
one concern; it reads the attributes ``Collective.__init__`` sets (``error_host``, ``_flag``,
``_zc``, ``_ce``, ``comm``, ``layout``, ``pad_ptrs``, ``timeout_ns``)."""

from __future__ import annotations

import ctypes

from purlinc import settings
from purlinc.atom.abi import ERROR_RECORD, decode_error
from purlinc.log import log
from purlinc.runtime.errors import PurlinTimeoutError, issued_by_one_thread


class Timeouts:
    """A Collective's error record and the timeouts it reports."""

    def error_record(self) -> dict[str, int]:
        words = tuple((ctypes.c_uint64 * len(ERROR_RECORD)).from_address(self.error_host))
        return decode_error(words)

    def check(self) -> None:
        """Raise PurlinTimeoutError if a device-side wait of this rank timed out (no sync needed).
        A closed collective has nothing to report: its error record is freed host memory."""
        if self.closed:
            return
        if self._flag.value:
            self._raise_timeout()
        if self._zc is not None:
            self._zc.twin.check()

    def timed_out(self) -> bool:
        """Whether a wait of this collective (or of its zero-copy twin) has timed out."""
        if self.closed:
            return False
        return bool(self._flag.value or (self._zc is not None and self._zc.twin._flag.value))

    def _ce_timed_out(self, waits, seconds: float) -> None:
        """The watchdog's report (from its thread): a ce call ran past the bound."""
        from purlinc.runtime.watchdog import write_error_record

        channel, index, address, value = waits[0] if waits else (0, 0, 0, 0)
        owner, word = 0, 0
        for peer, base in enumerate(self.pad_ptrs):
            if base <= address < base + self.layout.pad_bytes:
                owner, word = peer, (address - base) // 8
        write_error_record(self.error_host, self.rank, channel, index, owner, word, value, 0)

    def _raise_timeout(self):
        error = self._timeout_error()
        log.error("%s", error.message.splitlines()[0])
        self.comm.fail(error)
        raise error

    def _timeout_error(self) -> PurlinTimeoutError:
        record = self.error_record()
        schedule = self.compiled.schedule
        seconds = self.timeout_ns / 1e9
        if self._ce is not None:
            return PurlinTimeoutError(
                f"{self.name}: rank {record['rank']} (ce atom) did not finish a call within {seconds:g} s: "
                f"channel {record['channel']} was still waiting for signal r{record['signal_owner']}"
                f".sig[{record['signal_index']}] >= {record['expected']} (or a later wait of that call)",
                notes=(
                    "a peer did not call this collective (or called it with another count, dtype or op)",
                    "the watchdog released the copy engines' waits: that call's output is not valid",
                    f"the bound is {settings.WAIT_TIMEOUT_S.name}={settings.WAIT_TIMEOUT_S.raw()}",
                ),
                record=record,
            )
        what, step = "", None
        try:
            step = schedule.program(record["rank"], record["channel"]).steps[record["step"]]
            what = f" ({type(step).__name__}{': ' + step.note if getattr(step, 'note', '') else ''})"
        except (IndexError, KeyError):
            pass
        return PurlinTimeoutError(
            f"{self.name}: rank {record['rank']} timed out after {seconds:g} s in channel {record['channel']}, "
            f"step {record['step']}{what}, waiting for {_awaited(schedule, step, record)}",
            notes=(
                "a peer did not call this collective (or called it with another count, dtype or op)",
                *issued_by_one_thread(self.comm),
                "this collective's signals are now out of step: load it again",
                f"the bound is {settings.WAIT_TIMEOUT_S.name}={settings.WAIT_TIMEOUT_S.raw()}",
            ),
            record=record,
        )


def _awaited(schedule, step, record) -> str:
    """What the failed wait waited for.  A wait on packets (LL) records the value its packet
    flag stands for and the flag it saw (Schedule.packet_flags, packet_flag); it is shown as
    the signal's value too, which is what the schedule says."""
    from purlinc.snac.ir import Wait, packet_flag
    from purlinc.snac.packing import packed_stages

    signal = f"r{record['signal_owner']}.sig[{record['signal_index']}]"
    packets = {stage.signal for stage in packed_stages(schedule).values()}
    if not isinstance(step, Wait) or step.signal not in packets:
        return f"signal {signal} >= {record['expected']}, observed {record['observed']}"
    stride, base = schedule.packet_flags()[step.signal]
    epoch, k = divmod(record["expected"] - base - 1, stride)
    value = epoch * schedule.per_call()[step.signal] + k + 1
    return (f"the packets (LL) of signal {signal} >= {value}: packet flag {packet_flag(record['expected'])}, "
            f"observed {record['observed']}")
