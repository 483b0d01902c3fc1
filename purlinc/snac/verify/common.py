"""What every check of the verifier shares: its error type, how a step is described, and
where a failure points (rank, channel, step, call)."""

from __future__ import annotations

from purlinc.errors import PurlinError
from purlinc.frontend.ast import Operation
from purlinc.snac.ir import Consume, Epilogue, Notify, Region, Schedule, Stage, Step, Wait


CALLS = 2  # calls unrolled by the proof (see the module docstring for why two suffice)


class VerificationError(PurlinError):
    """A schedule that is not provably correct.  ``rank``/``channel``/``step``/``call`` locate
    the offending step (``None`` where the violation is not about one step)."""

    def __init__(
        self,
        message: str,
        span=None,
        notes=(),
        *,
        rank: int | None = None,
        channel: int | None = None,
        step: int | None = None,
        call: int | None = None,
    ):
        super().__init__(message, span, notes)
        self.rank = rank
        self.channel = channel
        self.step = step
        self.call = call


def describe(step: Step) -> str:
    """One step as short text, e.g. ``consume r2.stage[1].s0 -> r2.out[1].s0``."""
    if isinstance(step, Stage):
        if step.packed:
            return f"stage+notify {step.src.format()} -> {step.dst.format()}, {step.signal.format()} k={step.k} (LL)"
        return f"stage {step.src.format()} -> {step.dst.format()}"
    if isinstance(step, Notify):
        return f"notify {step.signal.format()} k={step.k}"
    if isinstance(step, Wait):
        return f"wait {step.signal.format()} k={step.k}"
    if isinstance(step, Epilogue):
        return f"epilogue {step.region.format()}"
    if not isinstance(step, Consume):  # a loaded or hand-built schedule's stray object
        return f"not a step: {type(step).__name__}"
    if step.operation is Operation.REDUCE:
        return f"reduce {' + '.join(r.format() for r in step.srcs)} -> {step.dst.format()}"
    return f"consume {' + '.join(r.format() for r in step.srcs)} -> {step.dst.format()}"


def step_kind(step: Step) -> str:
    return describe(step).split(" ", 1)[0]


def reads_of(step: Step) -> tuple[Region, ...]:
    kind = type(step)
    if kind is Stage:
        return (step.src,)
    if kind is Consume:
        return step.srcs
    return ()


def writes_of(step: Step) -> tuple[Region, ...]:
    kind = type(step)
    if kind is Stage or kind is Consume:
        return (step.dst,)
    return ()


class Failure:
    """Builds located errors for one schedule.

    The proof runs on the normalized schedule (packed stages split into Stage + Notify, see
    ``purlinc.snac.packing``); ``origins`` maps its step indices back to the schedule as
    written, so errors name the steps the user sees."""

    def __init__(self, schedule: Schedule, origins: dict | None = None, unroll: int = 1):
        self.schedule = schedule  # as normalized, before any unrolling (purlinc.snac.parity)
        self.origins = origins
        self.unroll = unroll  # original calls per proof call: steps past n are the next call's

    def split(self, rank: int, channel: int, index: int, call: int) -> tuple[int, int]:
        """(normalized step index, original call) of step ``index`` of proof call ``call``."""
        if self.unroll == 1:
            return index, call
        n = len(self.schedule.programs[rank].steps)
        return index % n, call * self.unroll + index // n

    def index(self, rank: int, channel: int, index: int | None) -> int | None:
        """The step index as written, of normalized (proof) step ``index``."""
        if index is None:
            return index
        index = self.split(rank, channel, index, 0)[0]
        if self.origins is None:
            return index
        return self.origins[rank, channel][index]

    def at(self, rank: int, channel: int, index: int, message: str, call: int = 0) -> VerificationError:
        normal, call = self.split(rank, channel, index, call)
        step = self.schedule.program(rank, channel).steps[normal]
        when = f" in call {call}" if call else ""
        written = self.index(rank, channel, index)
        text = f"rank {rank}, channel {channel}, step {written}{when} ({describe(step)}): {message}"
        return VerificationError(text, rank=rank, channel=channel, step=written, call=call)

    def short(self, rank: int, channel: int, index: int, call: int = 0) -> str:
        call = self.split(rank, channel, index, call)[1]
        when = f" in call {call}" if call else ""
        return f"rank {rank} channel {channel} step {self.index(rank, channel, index)}{when}"
