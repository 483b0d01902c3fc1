"""Disagreements between ranks, timeouts and the ce watchdog: the logic, without a GPU.

The GPU side (the same paths on two H200s, and a rank dying under torchrun) is in
tests/gpu/test_faults.py."""

from __future__ import annotations

import ctypes
import itertools
import threading

import pytest

from purlinc.atom.abi import ERROR_RECORD, decode_error
from purlinc.dtypes import DType, ReduceOp
from purlinc.runtime.collective import Collective, FastPath, prepare_group
from purlinc.runtime.communicator import Communicator
from purlinc.runtime.errors import ArgumentError, MismatchError, PurlinTimeoutError
from purlinc.runtime.validate import CallShape, CallSignature, call_signature, disagreement
from purlinc.runtime.watchdog import Watchdog, write_error_record


def sig(dtype="bfloat16", op=None, count=8, collective="allgather"):
    return CallSignature(collective, dtype, op, count)


# --- disagreement: exact texts ------------------------------------------------------------

NOTE = "note: every rank must make the same call: the same collective, dtype, op and count; nothing was launched"


def test_agreeing_ranks():
    assert disagreement("allgather", [sig(), sig()]) is None
    # A rank without buffers (dtype and count None) agrees with anything.
    assert disagreement("broadcast", [sig(), sig(dtype=None, count=None)]) is None


def test_dtype_disagreement():
    error = disagreement("allgather", [sig(), sig(dtype="float32")])
    assert isinstance(error, MismatchError)
    assert error.render() == ("error: allgather: the ranks disagree on the dtype: expected bfloat16 (as rank 0), "
                              "but rank 1 passed float32\n" + NOTE)


def test_count_disagreement_names_every_group():
    error = disagreement("allreduce", [sig(count=8), sig(count=8), sig(count=16), sig(count=4)])
    assert error.message == ("allreduce: the ranks disagree on the count: expected 8 elements per chunk "
                             "(as ranks 0, 1), but rank 2 passed 16 elements per chunk; "
                             "rank 3 passed 4 elements per chunk")


def test_op_disagreement():
    error = disagreement("allreduce", [sig(op="sum"), sig(op="max")])
    assert error.message == "allreduce: the ranks disagree on the op: expected sum (as rank 0), but rank 1 passed max"


def test_collective_disagreement_comes_first():
    error = disagreement("allgather", [sig(), sig(collective="allreduce (1234abcd)", dtype="float32")])
    assert error.message == ("allgather: the ranks disagree on the collective: expected allgather (as rank 0), "
                             "but rank 1 called allreduce (1234abcd)")


def test_signature_of_a_rank_without_chunks():
    shape = CallShape(DType.FLOAT32, None, 0, 0, 0)
    assert call_signature("c", shape, False) == CallSignature("c", None, None, None)
    shape = CallShape(DType.FLOAT16, ReduceOp.MAX, 12, 1, 2)
    assert call_signature("c", shape, True) == CallSignature("c", "float16", "max", 12)


def test_a_rank_without_chunks_that_gives_count_and_dtype_agrees_on_them():
    """Hierarchical phases give some ranks nothing to send or receive; such a rank passes
    count= and dtype= so that each new count changes its signature as it does the others'
    (with None it never changed, so it skipped the exchange the others waited in)."""
    from purlinc.runtime.validate import validate_call

    common = dict(name="h", rank=1, device=0, in_units=0, out_units=0, is_reduce=False)
    shape = validate_call(None, None, count=1000, dtype_hint="bfloat16", **common)
    assert (shape.dtype, shape.count, shape.in_ptr, shape.out_ptr) == (DType.BFLOAT16, 1000, 0, 0)
    assert call_signature("h", shape, False) == CallSignature("h", "bfloat16", None, 1000)
    assert validate_call(None, None, count=7, dtype_hint=DType.INT32, **common).dtype is DType.INT32
    with pytest.raises(ArgumentError, match="pass dtype= too"):
        validate_call(None, None, count=1000, **common)
    with pytest.raises(ArgumentError, match="not a dtype Purlin knows"):
        validate_call(None, None, count=1000, dtype_hint="complex128", **common)
    # no count: the call is a no-op on this rank, as before
    assert validate_call(None, None, **common).count == 0
    # a rank that receives chunks needs its output even when it says count and dtype
    receives = {**common, "out_units": 1}
    with pytest.raises(ArgumentError, match="out is required"):
        validate_call(None, None, count=1000, dtype_hint="bfloat16", **receives)
    with pytest.raises(ArgumentError, match="cannot be reduced"):
        validate_call(None, None, count=8, dtype_hint="float8_e4m3", **{**common, "is_reduce": True})


# --- group calls: checked before any launch ---------------------------------------------

class _FakeRank:
    def __init__(self, rank, dtype, count, units=1):
        self.rank, self.in_units, self.out_units = rank, units, units
        self.device = rank  # a GPU each
        self.events = []  # ("prime" | "launch", rank), shared by a group's ranks in the tests that look
        self.shape = CallShape(dtype, None, count, 0x1000 * (rank + 1), 0x9000 * (rank + 1))
        self.launched = False

    def prepare_call(self, x, out, op, stream, count, dtype=None):
        self.given = (count, dtype)
        return self.shape, 0, out

    def prime(self, shape, stream=None):
        self.events.append(("prime", self.rank))

    def blocks(self, shape, stream=None):  # no kernel to place (residency is tested in test_residency_cpu.py)
        return None

    def launch(self, shape, stream):
        self.launched = True
        self.events.append(("launch", self.rank))


def test_group_call_with_different_dtypes_is_refused_before_launch():
    ranks = [_FakeRank(0, DType.BFLOAT16, 8), _FakeRank(1, DType.FLOAT32, 8)]
    with pytest.raises(MismatchError) as caught:
        prepare_group("allgather", ranks, [1, 2], None, "sum", None, None)
    assert caught.value.message == ("allgather: the ranks disagree on the dtype: expected bfloat16 (as rank 0), "
                                    "but rank 1 passed float32")
    assert not any(r.launched for r in ranks)


def test_group_call_with_different_counts():
    ranks = [_FakeRank(0, DType.BFLOAT16, 8), _FakeRank(1, DType.BFLOAT16, 9)]
    with pytest.raises(MismatchError, match="disagree on the count: expected 8 elements per chunk"):
        prepare_group("allgather", ranks, [1, 2], None, "sum", None, None)


def test_group_call_rank_without_chunks_is_not_a_disagreement():
    ranks = [_FakeRank(0, DType.BFLOAT16, 8), _FakeRank(1, DType.FLOAT32, 0, units=0)]
    assert len(prepare_group("odd", ranks, [1, None], None, "sum", None, None)) == 2


def test_group_call_gives_a_rank_without_chunks_the_others_count_and_dtype():
    """Its program may carry the others' data (a ring relays through it): one process holds
    every rank's buffers, so the group call passes it what they say, as torchrun ranks pass
    count= and dtype= themselves."""
    ranks = [_FakeRank(0, DType.FLOAT32, 0, units=0), _FakeRank(1, DType.BFLOAT16, 8), _FakeRank(2, DType.BFLOAT16, 8)]
    prepare_group("odd", ranks, [None, 1, 2], None, "sum", None, None)
    assert ranks[0].given == (8, DType.BFLOAT16) and ranks[1].given == (None, None)
    prepare_group("odd", ranks, [None, 1, 2], None, "sum", None, 8)  # count= given: the same
    assert ranks[0].given == (8, DType.BFLOAT16) and ranks[1].given == (8, None)
    empty = [_FakeRank(0, DType.FLOAT32, 0, units=0), _FakeRank(1, DType.BFLOAT16, 0)]
    prepare_group("odd", empty, [None, 1], None, "sum", None, None)  # an empty call: count 0, said
    assert empty[0].given == (0, DType.BFLOAT16)


class _Array:
    """One rank's buffer (what a group call's lists hold), iterable like a tensor is."""

    def __init__(self, n):
        self.shape, self.n = (n,), n
        self.__cuda_array_interface__ = {"data": (0x1000, False), "shape": (n,), "typestr": "<f4", "version": 3}

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self):
        return self.n


@pytest.mark.parametrize("label", ["xs", "outs", "streams"])
def test_group_call_refuses_one_array_where_a_list_per_rank_goes(label):
    """gcoll(x) for gcoll([x0, x1]): list(x) made one rank's input of each row of x, so a tensor
    of R rows in a loopback group (one device) ran as R inputs."""
    ranks = [_FakeRank(0, DType.FLOAT32, 8), _FakeRank(1, DType.FLOAT32, 8)]
    args = {"xs": [1, 2], "outs": None, "streams": None, label: _Array(2)}
    with pytest.raises(ArgumentError) as caught:
        prepare_group("allgather", ranks, args["xs"], args["outs"], "sum", args["streams"], None)
    assert caught.value.message == (f"allgather: {label} is one array (_Array), expected a list of 2 entries "
                                    "(one per rank)")


class _Stream:
    """One stream object (not iterable), as torch.cuda.current_stream() gives."""


@pytest.mark.parametrize("label", ["xs", "outs", "streams"])
@pytest.mark.parametrize("value, shown", [(_Stream(), "_Stream"), (7, "int"), ("ab", "str"), ({0: 1, 1: 2}, "dict")])
def test_group_call_refuses_one_value_where_a_list_per_rank_goes(label, value, shown):
    """gcoll(xs, streams=stream) for streams=[s0, s1]: list() of one stream (or a number) was a
    TypeError from inside; a string or a dict made a rank's entry of each character or key."""
    ranks = [_FakeRank(0, DType.FLOAT32, 8), _FakeRank(1, DType.FLOAT32, 8)]
    args = {"xs": [1, 2], "outs": None, "streams": None, label: value}
    with pytest.raises(ArgumentError) as caught:
        prepare_group("allgather", ranks, args["xs"], args["outs"], "sum", args["streams"], None)
    assert caught.value.message == f"allgather: {label} is one {shown}, expected a list of 2 entries (one per rank)"


class _StreamRank(_FakeRank):
    """A rank on ``device`` whose call resolves to ``stream``."""

    name = "allgather"

    def __init__(self, rank, device, stream):
        super().__init__(rank, DType.BFLOAT16, 8)
        self.device, self.stream = device, stream

    def prepare_call(self, x, out, op, stream, count):
        return self.shape, self.stream, out


def test_loopback_group_call_needs_one_stream_per_rank():
    """Ranks sharing a GPU wait for each other's kernels: one stream for both would hang
    until the device-side timeout, so the call is refused before anything is launched."""
    from purlinc.runtime.collective import GroupCollective

    ranks = [_StreamRank(0, 0, 0x70), _StreamRank(1, 0, 0x70)]
    with pytest.raises(ArgumentError) as caught:
        GroupCollective(ranks)([1, 2])
    assert caught.value.message == ("allgather: ranks 0 and 1 share cuda:0 and would run on one stream (0x70), "
                                    "so each would wait for the other forever: pass streams= with one stream per rank")
    assert not any(r.launched for r in ranks)
    ranks = [_StreamRank(0, 0, 0x70), _StreamRank(1, 0, 0x80)]  # one stream each
    ranks[1].events = ranks[0].events
    GroupCollective(ranks)([1, 2])
    # Every kernel is loaded before the first launch: a module load may wait for the running
    # kernels, and a launched rank on a shared GPU runs until the others come.
    assert ranks[0].events == [("prime", 0), ("prime", 1), ("launch", 0), ("launch", 1)]
    ranks = [_StreamRank(0, 0, 0), _StreamRank(1, 1, 0)]  # two GPUs' default streams are two streams
    GroupCollective(ranks)([1, 2])
    assert all(r.launched for r in ranks)


def test_local_group_refuses_a_repeated_device_unless_shared():
    from purlinc.runtime.communicator import LocalGroup

    with pytest.raises(ValueError, match=r"distinct devices, got \[0, 0\] \(share_devices=True runs several ranks"):
        LocalGroup([0, 0])
    with pytest.raises(ValueError, match="at least one device"):
        LocalGroup([])


# --- torchrun: one exchange per new signature -------------------------------------------

class _FakeComm:
    def __init__(self, others):
        self.others = others  # what the other ranks send, per exchange
        self.exchanges = 0
        self.failed = None

    def allgather(self, obj):
        self.exchanges += 1
        return [obj] + [(obj[0], other) for other in self.others]


def _torchrun_rank(comm):
    rank = object.__new__(Collective)
    rank.name, rank.comm, rank.in_units, rank.out_units = "allgather", comm, 1, 2
    rank._identity, rank._agreed = "allgather (00000000)", set()
    return rank


def test_first_use_exchanges_once_then_never_again():
    comm = _FakeComm([("allgather (00000000)", "bfloat16", None, 8)])
    rank = _torchrun_rank(comm)
    shape = CallShape(DType.BFLOAT16, None, 8, 1, 2)
    for _ in range(100):
        rank._agree_on(shape)
    assert comm.exchanges == 1


def test_first_use_mismatch_under_torchrun():
    comm = _FakeComm([("allgather (00000000)", "bfloat16", None, 16)])
    rank = _torchrun_rank(comm)
    with pytest.raises(MismatchError) as caught:
        rank._agree_on(CallShape(DType.BFLOAT16, None, 8, 1, 2))
    assert caught.value.message == ("allgather: the ranks disagree on the count: expected 8 elements per chunk "
                                    "(as rank 0), but rank 1 passed 16 elements per chunk")
    assert rank._agreed == set()  # not remembered: the next call exchanges (and fails) again


def test_another_collective_under_torchrun():
    comm = _FakeComm([("allreduce (11111111)", "bfloat16", "sum", 8)])
    rank = _torchrun_rank(comm)
    with pytest.raises(MismatchError, match=r"disagree on the collective: expected allgather \(00000000\) "
                                            r"\(as rank 0\), but rank 1 called allreduce \(11111111\)"):
        rank._agree_on(CallShape(DType.BFLOAT16, None, 8, 1, 2))


# --- after a timeout the communicator refuses ------------------------------------------

def test_a_failed_communicator_refuses_calls_and_fast_paths():
    comm = Communicator(0, 2, 0, heap=None, exchange=None)
    timeout = PurlinTimeoutError("allgather: rank 0 timed out after 5 s in channel 0, step 2\nmore")

    class _Registered:
        name = "allgather"
        _fast = "something"

    registered = _Registered()
    comm.register(registered)
    comm.fail(timeout)
    assert comm.failed is timeout and registered._fast is None
    with pytest.raises(PurlinTimeoutError) as caught:
        comm.refuse("allreduce")
    assert caught.value.render() == (
        "error: allreduce: rank 0's communicator stopped after an earlier timeout "
        "(allgather: rank 0 timed out after 5 s in channel 0, step 2)\n"
        "note: the ranks' signals are out of step (or a peer is gone): create a new Communicator or "
        "LocalGroup and load the collectives again"
    )

    class _Collective:
        name = "allgather"

    fast = object.__new__(FastPath)
    collective = _Collective()
    collective.comm = comm
    with pytest.raises(PurlinTimeoutError, match="stopped after an earlier timeout"):
        fast.launch(collective)


# --- the ce watchdog -----------------------------------------------------------------------

class _FakeOps:
    def __init__(self):
        self.done: dict[int, bool] = {}
        self.writes: list = []
        self.capturing = False
        self.ids = itertools.count()
        self.destroyed = []

    def event_create(self):
        return next(self.ids)

    def event_record(self, event, stream):
        self.done[event] = False

    def event_done(self, event):
        return self.done[event]

    def event_destroy(self, event):
        self.destroyed.append(event)

    def is_capturing(self, stream):
        return self.capturing

    def stream_create(self):
        return "release-stream"

    def write_value64(self, stream, address, value):
        self.writes.append((stream, address, value))

    def set_current(self, device):
        pass

    def relax_capture_mode(self):
        self.relaxed = threading.get_ident()


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _watchdog():
    ops, clock = _FakeOps(), _Clock()
    dog = Watchdog(ops, clock=clock)
    dog._ensure_thread = lambda: None  # the test drives poll() itself
    fired = []
    dog.register(1, 0, 5.0, lambda waits, seconds: fired.append((waits, seconds)))
    return dog, ops, clock, fired


def test_watchdog_leaves_finished_calls_alone():
    dog, ops, clock, fired = _watchdog()
    dog.track(1, "s", [(0, 3, 0x100, 7)])
    clock.now += 4
    dog.poll()
    ops.done[0] = True
    clock.now += 10
    dog.poll()
    assert fired == [] and ops.writes == [] and ops.destroyed == [0]


def test_watchdog_releases_a_stuck_wait_and_reports_once():
    dog, ops, clock, fired = _watchdog()
    dog.track(1, "s", [(0, 3, 0x100, 7), (1, 5, 0x208, 9)])
    dog.poll()
    clock.now += 5.5
    dog.poll()
    assert ops.writes == [("release-stream", 0x100, 7), ("release-stream", 0x208, 9)]
    assert fired == [(((0, 3, 0x100, 7), (1, 5, 0x208, 9)), 5.5)]
    clock.now += 60
    dog.poll()
    assert len(fired) == 1  # once: the collective now refuses calls
    dog.track(1, "s", [(0, 3, 0x100, 8)])  # and later calls are no longer watched
    assert len(dog._watched[1].calls) == 1


def test_watchdog_clock_starts_when_a_call_becomes_the_oldest():
    # Ten calls queued at once, each taking 3 s: none is stuck, though the last ends 30 s later.
    dog, ops, clock, fired = _watchdog()
    for _ in range(10):
        dog.track(1, "s", [(0, 0, 0x100, 1)])
    for event in range(10):
        clock.now += 3
        dog.poll()
        ops.done[event] = True
    dog.poll()
    assert fired == [] and not dog._watched[1].calls


def test_watchdog_ignores_graph_capture():
    dog, ops, clock, fired = _watchdog()
    ops.capturing = True
    dog.track(1, "s", [(0, 0, 0x100, 1)])
    assert not dog._watched[1].calls


def test_watchdog_destroys_each_event_once_when_a_runner_closes():
    # Seen on 2 x H200: close() and the thread both destroyed one event (a segfault).
    dog, ops, clock, fired = _watchdog()
    dog.track(1, "s", [(0, 3, 0x100, 7)])
    dog.track(1, "s", [(0, 3, 0x100, 8)])
    items = list(dog._watched.items())  # what a poll already in flight had picked up
    dog.unregister(1)
    ops.done[0] = ops.done[1] = True
    dog.poll()
    for _, watched in items:
        assert not watched.calls
    assert sorted(ops.destroyed) == [0, 1]


def test_watchdog_thread_runs_in_relaxed_capture_mode():
    # Seen on 2 x H200: under torch's global capture mode, the thread's event queries
    # invalidated graph captures made by other threads (cudaErrorStreamCaptureInvalidated).
    ops = _FakeOps()
    dog = Watchdog(ops, poll_s=0.001)
    dog._ensure_thread()
    dog._thread.join(0.05)
    dog.stop()
    dog._thread.join(1.0)
    assert getattr(ops, "relaxed", None) == dog._thread.ident


def test_error_record_written_like_a_kernel_would():
    record = (ctypes.c_uint64 * len(ERROR_RECORD))()
    write_error_record(ctypes.addressof(record), rank=1, channel=2, step=3, owner=0, index=4, expected=5, observed=0)
    assert decode_error(tuple(record)) == {"flag": 1, "rank": 1, "channel": 2, "step": 3, "signal_owner": 0,
                                           "signal_index": 4, "expected": 5, "observed": 0}


def test_a_timeout_where_one_thread_issues_every_rank_says_to_warm_up():
    """A LocalGroup's ranks are issued by one thread: a first launch's module load waits for the
    running exchange, so a peer may never have been issued.  The note says so there only."""
    from types import SimpleNamespace

    from purlinc.runtime.errors import issued_by_one_thread

    (note,) = issued_by_one_thread(SimpleNamespace(local_group=object()))
    assert "first launch" in note and "warm it up" in note
    assert issued_by_one_thread(SimpleNamespace(local_group=None)) == ()
    assert issued_by_one_thread(SimpleNamespace()) == ()


def test_a_tuned_call_passes_count_and_dtype_of_a_rank_without_chunks():
    """``load()``'s default (a Tuned) takes the same count= / dtype= as one Collective."""
    from types import SimpleNamespace

    from purlinc.runtime.tuned import Tuned
    from purlinc.runtime.tuning import Bucket

    seen = []

    class Variant(SimpleNamespace):
        closed = False

        def prepare_call(self, x, out, op, stream, count, dtype=None, *, agree=True):
            seen.append((count, dtype))
            return CallShape(DType.BFLOAT16, None, count, 0, 0), 0, None

        def agree(self, shape):
            seen.append("agree")

        def launch(self, shape, handle, epilogue=()):
            seen.append("launch")

        def replay_target(self, shape):
            return None, None

        def timed_out(self):
            return False

    variant = Variant(name="h", comm=None, rank=1, out_units=0)
    tuned = Tuned([Bucket(None)], [variant], 1)
    tuned(None, None, count=1000, dtype="bfloat16")
    assert seen == [(1000, "bfloat16"), "agree", "launch"]


def test_a_tuned_call_sees_a_timeout_of_any_bucket_or_zero_copy_twin():
    """Before replaying anything, a Tuned call reads every bucket's error flag and every
    zero-copy twin's, and raises through ``check`` when one is set."""
    import ctypes
    from types import SimpleNamespace

    from purlinc.runtime.tuned import Tuned
    from purlinc.runtime.tuning import Bucket

    class Timeout(Exception):
        pass

    class Variant(SimpleNamespace):
        closed = False

        def check(self):
            for collective in (self, getattr(self._zc, "twin", None)):
                if collective is not None and collective._flag.value:
                    raise Timeout(collective.name)

        def prepare_call(self, *args, **kwargs):
            raise AssertionError("a timed-out collective must not get as far as a call")

    twin = SimpleNamespace(name="twin", _flag=ctypes.c_uint64(0))
    staged = Variant(name="staged", comm=None, rank=0, out_units=1, _flag=ctypes.c_uint64(0),
                     _zc=SimpleNamespace(twin=twin))
    packed = Variant(name="packed", comm=None, rank=0, out_units=1, _flag=ctypes.c_uint64(0), _zc=None)
    tuned = Tuned([Bucket(1024), Bucket(None)], [packed, staged], 1)
    assert len(tuned._flags) == 3
    twin._flag.value = 1
    with pytest.raises(Timeout, match="twin"):
        tuned(None, None, count=8, dtype="bfloat16")
    twin._flag.value = 0
    packed._flag.value = 1
    with pytest.raises(Timeout, match="packed"):
        tuned(None, None, count=8, dtype="bfloat16")


@pytest.mark.parametrize("label, value", [("x", [1.0, 2.0]), ("out", "buffer")])
def test_a_call_on_something_that_is_no_array_names_the_argument(label, value):
    """Before anything else is read: an ArgumentError naming x or out and the type given, not a
    TypeError from deep inside the interop layer."""
    coll = object.__new__(Collective)
    coll.name, coll.rank, coll.closed, coll._zc = "allgather", 1, False, None
    coll._flag, coll.comm = ctypes.c_uint64(0), object()
    x, out = (value, None) if label == "x" else (None, value)
    with pytest.raises(ArgumentError) as info:
        coll.prepare_call(x, out, None, 0, None)
    assert info.value.message.startswith(f"allgather on rank 1: {label}: expected a torch tensor")
    assert info.value.message.endswith(f"got {type(value).__name__}")
