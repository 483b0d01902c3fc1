"""Calls and objects given what a user can get wrong, refused by name before anything is launched:
tensors Purlin cannot carry (quantized, sparse, read-only, on the meta device), a ``dtype=`` that
contradicts the buffers, arguments of the wrong kind to the torch wrappers and to collectives with
run-time sizes, and a bad stream before the ranks agree.  Also what must run: an empty batch of a
bf16 fused all-reduce + RMSNorm.  CPU only: a recording stand-in for the driver
(test_runtime_load_cpu's ``fake``), CPU tensors described as on cuda:0."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import purlinc.torch as pt  # noqa: E402
from purlinc.errors import PurlinError  # noqa: E402
from purlinc.runtime import driver, interop  # noqa: E402
from purlinc.runtime.errors import ArgumentError  # noqa: E402
from purlinc.runtime.loader import load  # noqa: E402
from purlinc.torch.serving import PurlinAllReduce  # noqa: E402
import test_runtime_load_cpu  # noqa: E402
from test_runtime_load_cpu import FakeComm  # noqa: E402

fake = test_runtime_load_cpu.fake  # the recording driver stand-in, a fixture shared with that module

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture
def on_cuda0(fake, monkeypatch):
    """CPU tensors described as cuda:0 tensors (launches are recorded, not run)."""
    real = interop._describe_torch

    def describe(x):
        info = real(x)
        return replace(info, device=0) if x.device.type == "cpu" else info
    monkeypatch.setattr(interop, "_describe_torch", describe)
    monkeypatch.setattr(interop, "current_stream", lambda kind, device: 0)
    table = {v: k for k, v in interop._torch_dtype_map().items()}
    monkeypatch.setattr(interop, "empty_like_kind",
                        lambda kind, numel, dtype, device, like=None: torch.empty(numel, dtype=table[dtype]))
    for name in ("launch", "memcpy_async", "event_record", "stream_wait_event", "write_value64"):
        monkeypatch.setattr(driver, name, lambda *args: None, raising=False)
    monkeypatch.setattr(driver, "stream_capturing", lambda stream: False)
    monkeypatch.setattr(driver, "pointer_device", lambda ptr: 0)
    monkeypatch.setattr(driver, "reserve_stack", lambda n: None, raising=False)
    return fake


class _Comm:
    rank, world_size, device = 0, 1, "cpu"


def _group(**options):
    return pt.Group(_Comm(), loader=lambda *args: pytest.fail("nothing is loaded"), **options)


# ---- tensors Purlin cannot carry ---------------------------------------------------------

@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")  # deprecated in torch, still made by users
def test_quantized_and_sparse_tensors_are_refused_by_name():
    """A quantized tensor was carried as the bytes of a float8 view, whose clone crashed torch
    (a segmentation fault); its bytes lack its scale and zero point anyway."""
    g = _group()
    quantized = torch.quantize_per_tensor(torch.ones(4), 1.0, 0, torch.qint8)
    with pytest.raises(ArgumentError, match=r"broadcast: tensor is a quantized tensor \(qint8\); expected a dense "
                                            r"tensor of plain values"):
        g.broadcast(quantized, src=0)
    sparse = torch.eye(4).to_sparse()
    for call in (lambda: g.broadcast(sparse, src=0), lambda: g.all_reduce(sparse)):
        with pytest.raises(ArgumentError, match=r"tensor has layout sparse_coo; expected a dense \(strided\) tensor"):
            call()


def test_a_meta_tensor_and_a_read_only_array_are_named(on_cuda0):
    coll = load(EXAMPLES / "allreduce.pln", FakeComm(), channels=1)
    with pytest.raises(ArgumentError, match=r"allreduce on rank 0: x is on meta \(not a CUDA device\), expected "
                                            r"cuda:0"):
        coll(torch.ones(8, device="meta"))
    read_only = np.ones(8, dtype=np.float32)
    read_only.setflags(write=False)
    with pytest.raises(ArgumentError, match=r"allreduce on rank 0: x: .*readonly"):  # not a bare BufferError
        coll(read_only)


class _ArrayInterface:
    def __init__(self, ptr: int, shape: tuple, typestr: str = "<f4"):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False), "version": 3,
                                         "strides": None}


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")  # torch's, then ours
def test_arrays_whose_memory_does_not_hold_their_values_are_refused(on_cuda0, monkeypatch):
    """A lazily negated view (the kernel would read the un-negated memory), a fake tensor and an
    array interface at address 0 (a kernel on a null pointer faults the context), and one that
    runs past the address space: each named, before a launch."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    launches = []
    monkeypatch.setattr(driver, "launch", lambda *args: launches.append(args))
    coll = load(EXAMPLES / "allreduce.pln", FakeComm(), channels=1)
    with pytest.raises(ArgumentError, match=r"allreduce on rank 0: x is a lazily negated view: its memory holds the "
                                            r"negation of its values"):
        coll(torch.ones(8)._neg_view(), torch.empty(8))
    with FakeTensorMode():
        fake_x, fake_out = torch.empty(8), torch.empty(8)
    with pytest.raises(ArgumentError, match=r"allreduce on rank 0: x has 8 elements at address 0, expected memory "
                                            r"on the GPU"):
        coll(fake_x, fake_out)
    with pytest.raises(ArgumentError, match=r"x has 8 elements at address 0"):
        coll(_ArrayInterface(0, (8,)), _ArrayInterface(1 << 20, (8,)))
    with pytest.raises(ArgumentError, match=r"x spans \[0xfffffffffffffff0, 0x10000000000000010\), past the end of "
                                            r"the 64-bit address space"):
        coll(_ArrayInterface((1 << 64) - 16, (8,)), _ArrayInterface(1 << 20, (8,)))
    with pytest.raises(ArgumentError, match=r"allreduce on rank 0: x: __cuda_array_interface__ has shape \(-8,\), "
                                            r"expected no negative dimension"):
        coll(_ArrayInterface(1 << 20, (-8,)), _ArrayInterface(1 << 21, (8,)))
    assert not launches
    coll(torch.ones(8), torch.empty(8))  # nothing was left half-changed
    assert len(launches) == 1


def test_a_negative_eps_is_refused_as_the_torch_op_and_the_language_refuse_it(on_cuda0):
    coll = load(FUSED, FakeComm(), params={"hidden": 64}, channels=1)
    x = torch.ones(2, 64)
    with pytest.raises(ArgumentError, match=r"allreduce_add_rmsnorm: operand 'eps': rmsnorm's eps must be >= 0, "
                                            r"got -1.0"):
        coll(x, residual=torch.ones(2, 64), weight=torch.ones(64), eps=-1.0)
    coll(x, residual=torch.ones(2, 64), weight=torch.ones(64), eps=0.0)


def test_epilogue_operands_get_the_same_memory_checks(on_cuda0):
    coll = load(FUSED, FakeComm(), params={"hidden": 64}, channels=1)
    x = torch.ones(2, 64)
    with pytest.raises(ArgumentError, match=r"operand 'weight' is a lazily negated view"):
        coll(x, residual=torch.ones(2, 64), weight=torch.ones(64)._neg_view(), eps=1e-6)
    read_only = np.ones(64, dtype=np.float32)
    read_only.setflags(write=False)
    with pytest.raises(ArgumentError, match=r"operand 'weight': .*readonly"):  # not a bare BufferError
        coll(x, residual=torch.ones(2, 64), weight=read_only, eps=1e-6)


def test_a_dtype_that_contradicts_the_buffers_is_refused(on_cuda0):
    """dtype= is for a rank that passes no buffer; beside buffers of another dtype it was ignored."""
    coll = load(EXAMPLES / "allreduce.pln", FakeComm(), channels=1)
    with pytest.raises(ArgumentError, match=r"dtype=bfloat16, but the buffers have dtype float32"):
        coll(torch.ones(8), dtype="bfloat16")
    with pytest.raises(ArgumentError, match=r"dtype='float64' is not a dtype Purlin knows"):
        coll(torch.ones(8), dtype="float64")
    coll(torch.ones(8), dtype="float32")  # agreeing: taken
    coll(torch.ones(8), dtype="f32")  # an alias DType.parse takes


def test_an_empty_batch_of_a_bf16_fused_call_runs(on_cuda0):
    """Zero rows of a bf16 decoder step: the empty call was taken as float32 and its bf16
    operands refused ("operand 'residual': expected dtype float32, got bfloat16")."""
    hidden = 64
    coll = load(EXAMPLES / "fused" / "allreduce_add_rmsnorm.pln", FakeComm(), params={"hidden": hidden}, channels=1)
    fused = pt.fused_add_rmsnorm_op(coll, device="cpu")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        empty = torch.empty(0, hidden, dtype=dtype)
        with torch.no_grad():
            y = fused(empty, torch.empty_like(empty), torch.ones(hidden, dtype=dtype), 1e-6)
        assert tuple(y.shape) == (0, hidden) and y.dtype == dtype
    wrong = torch.empty(0, hidden, dtype=torch.bfloat16)
    with pytest.raises(ArgumentError, match=r"operand 'residual': expected dtype bfloat16, got float16"):
        coll(wrong, residual=torch.empty(0, hidden, dtype=torch.float16), weight=torch.ones(hidden, dtype=torch.bfloat16),
             eps=1e-6)


def test_a_bad_stream_is_refused_before_the_ranks_agree(on_cuda0, monkeypatch):
    """Refused after its peers had agreed, a rank left them launched and waiting until their timeout."""
    coll = load(EXAMPLES / "allreduce.pln", FakeComm(), channels=1)
    coll._agree = True
    monkeypatch.setattr(coll, "_agree_on", lambda shape: pytest.fail("the ranks agreed before the stream was checked"))
    with pytest.raises(ArgumentError, match=r"allreduce on rank 0: stream='7': expected a CUDA stream"):
        coll(torch.ones(8), stream="7")


FUSED = EXAMPLES / "fused" / "allreduce_add_rmsnorm.pln"


@pytest.mark.parametrize("tuned", [False, True], ids=["pinned", "tuned"])
def test_operands_are_refused_before_the_ranks_agree(on_cuda0, monkeypatch, tuned):
    """As a stream: an operand refused after the peers agreed left them waiting for this rank."""
    pin = {} if tuned else {"channels": 1}
    plain = load(EXAMPLES / "allreduce.pln", FakeComm(), **pin)
    fused = load(FUSED, FakeComm(), params={"hidden": 64}, **pin)
    for coll in (plain, fused):
        first = coll.variants[0] if tuned else coll
        first._agree = True
        monkeypatch.setattr(first, "_agree_on", lambda shape: pytest.fail("the ranks agreed before the operands "
                                                                          "were checked"))
    with pytest.raises(ArgumentError, match=r"allreduce: unknown operand 'bogus'"):
        plain(torch.ones(8), torch.empty(8), bogus=1)
    x = torch.ones(2, 64)
    with pytest.raises(ArgumentError, match=r"operand 'eps': expected a finite float32 value, got nan"):
        fused(x, residual=torch.ones(2, 64), weight=torch.ones(64), eps=float("nan"))


@pytest.mark.parametrize("tuned", [False, True], ids=["pinned", "tuned"])
def test_the_replayed_call_does_not_take_operands_it_would_refuse(on_cuda0, tuned):
    """After one good call the fast path replays it: it ignored operands, so an unknown one
    passed silently from the second call on."""
    coll = load(EXAMPLES / "allreduce.pln", FakeComm(), **({} if tuned else {"channels": 1}))
    x, out = torch.ones(8), torch.empty(8)
    coll(x, out)
    coll(x, out)
    assert coll._fast is not None
    with pytest.raises(ArgumentError, match=r"allreduce: unknown operand 'bogus'"):
        coll(x, out, bogus=1)


def test_a_group_call_refuses_an_output_another_rank_also_uses(on_cuda0):
    """One process holds every rank's buffers: two ranks writing one buffer, or one writing what
    another reads, race (within one rank the same overlap was already refused)."""
    from types import SimpleNamespace

    from purlinc.runtime.collective import GroupCollective

    comms = [FakeComm(), FakeComm()]
    comms[1].rank = 1
    for comm in comms:
        comm.local_group = SimpleNamespace(devices=[0, 0], comms=[])
    group = GroupCollective([load(EXAMPLES / "allreduce.pln", comm, channels=1) for comm in comms])
    xs, streams = [torch.ones(8), torch.ones(8)], [1, 2]
    shared = torch.empty(8)
    with pytest.raises(ArgumentError, match=r"allreduce: rank 0's out overlaps rank 1's out in memory, expected a "
                                            r"buffer of its own"):
        group(xs, [shared, shared], streams=streams)
    with pytest.raises(ArgumentError, match=r"allreduce: rank 0's out overlaps rank 1's x in memory"):
        group([torch.ones(8), shared], [shared, torch.empty(8)], streams=streams)
    one_input = torch.ones(8)  # read by both: allowed
    group([one_input, one_input], [torch.empty(8), torch.empty(8)], streams=streams)


def test_a_tuned_load_refuses_trace_by_name(on_cuda0):
    coll = load(EXAMPLES / "allreduce.pln", FakeComm())
    with pytest.raises(PurlinError, match=r"allreduce: not loaded with trace=True: this load picks a schedule per "
                                          r"call size"):
        coll.trace()


# ---- collectives with run-time sizes ----------------------------------------------------

def test_sized_calls_name_their_arguments(on_cuda0):
    coll = load(EXAMPLES / "sized" / "alltoallv.pln", FakeComm(), capacity=64)
    sizes, out, out_sizes = torch.tensor([50, 50]), torch.empty(128), torch.empty(2, dtype=torch.int64)
    for args, message in (
        (([1.0] * 100, sizes, out, out_sizes), r"alltoallv on rank 0: x: expected a torch tensor.* got list"),
        ((None, sizes, out, out_sizes), r"alltoallv on rank 0: x is required, got None"),
        ((torch.ones(100), [50, 50], out, out_sizes), r"alltoallv on rank 0: sizes: expected a torch tensor.* got list"),
        ((torch.ones(100), None, out, out_sizes), r"alltoallv on rank 0: n \(the sizes of this rank.s input chunks\) is "
                                                  r"required, got None"),
    ):
        with pytest.raises(ArgumentError, match=message):
            coll(*args)
    with pytest.raises(ArgumentError, match=r"row=True, expected elements per size unit in 1\.\.64"):
        coll(torch.ones(100), sizes, out, out_sizes, row=True)


def test_sized_load_on_the_ce_atom_says_why(fake):
    """The ce atom's own check spoke first, of staging copies a sized load cannot choose."""
    with pytest.raises(PurlinError) as info:
        load(EXAMPLES / "sized" / "alltoallv.pln", FakeComm(), capacity=16, atom="ce")
    assert info.value.message == "run-time sizes run on the 'ldst' atom only, not 'ce'"
    assert "the copy engines take sizes from the host" in info.value.notes[0]


# ---- the torch wrappers' arguments --------------------------------------------------------

def test_op_takes_one_ranks_loaded_collective_and_a_device():
    from purlinc.runtime.collective import GroupCollective

    for coll, message in (
        ("examples/allgather.pln", r"purlinc.torch.op: expected a loaded collective, got str"),
        (EXAMPLES / "allgather.pln", r"purlinc.torch.op: expected a loaded collective, got PosixPath"),
        (None, r"purlinc.torch.op: expected a loaded collective \(purlinc.load\(path, comm\)\), got NoneType"),
        (GroupCollective.__new__(GroupCollective), r"expected one rank's collective, got a LocalGroup's"),
    ):
        if isinstance(coll, GroupCollective):
            coll.ranks = []
        with pytest.raises(ArgumentError, match=message):
            pt.op(coll)
    with pytest.raises(ArgumentError, match=r"fused_add_rmsnorm_op: expected a loaded collective, got str"):
        pt.fused_add_rmsnorm_op("x")


def test_a_device_string_torch_cannot_read_is_named():
    with pytest.raises(ArgumentError, match=r"Group: device='gpu0', expected a torch.device, a device string"):
        _group(device="gpu0")
    assert _group(device="cpu").device == torch.device("cpu")


def test_group_refuses_a_communicator_it_cannot_use_and_unknown_load_options(monkeypatch):
    from purlinc.torch import groups

    monkeypatch.setattr(groups, "_DEFAULT", [])  # init() below sets the default group: this test's alone
    for comm in (None, "comm"):
        with pytest.raises(ArgumentError, match=rf"Group: comm must be a Purlin communicator .* got "
                                                rf"{type(comm).__name__}"):
            pt.init(comm)
    # a misspelt option surfaced at the first collective as load()'s TypeError; capacity loaded
    # every fixed-size collective as one with run-time sizes
    for options, unknown in (({"chanels": 2}, "chanels"), ({"capacity": 5}, "capacity"), ({"params": {}}, "params")):
        with pytest.raises(ArgumentError, match=rf"Group: unknown load option\(s\) {unknown}; expected some of "
                                                r"algorithm, atom, channels"):
            _group(**options)
    with pytest.raises(PurlinError, match="trace must be True or False, got 'no'"):
        _group(trace="no")
    assert _group(channels=2, algorithm="ring")
    group = _group()
    with pytest.raises(ArgumentError, match=r"init: load options \(bogus_option, channels\) beside a Group: the "
                                            r"group was made with its own"):
        pt.init(group, bogus_option=1, channels=4)  # were dropped without a word
    assert pt.init(group) is group


def test_a_closed_collective_loads_nothing_more(on_cuda0):
    """warm() after close() loaded a module never unloaded (and, under torchrun, exchanged)."""
    for pin in ({"channels": 1}, {}):
        coll = load(EXAMPLES / "allreduce.pln", FakeComm(), **pin)
        coll.close()
        loads = len([call for call in on_cuda0 if call[0] == "module_load"])
        with pytest.raises(ArgumentError, match=r"allreduce: this collective was closed"):
            coll.warm("float32")
        assert len([call for call in on_cuda0 if call[0] == "module_load"]) == loads


@pytest.mark.parametrize("value", ["8", 1.5, -1, True, None])
def test_serving_max_bytes_is_a_whole_number_of_bytes(value):
    with pytest.raises(ArgumentError, match=rf"PurlinAllReduce: max_bytes={value!r}, expected a whole number of "
                                            r"bytes >= 0".replace("(", r"\(")):
        PurlinAllReduce(_group(), max_bytes=value)
    assert PurlinAllReduce(_group(), max_bytes=np.int64(1024)).max_bytes == 1024
    with pytest.raises(ArgumentError, match=r"should_custom_ar: inp must be a torch.Tensor, got str"):
        PurlinAllReduce(_group()).should_custom_ar("x")


@pytest.mark.parametrize("options, message", [
    ({"channels": True}, r"channels must be an integer, got True"),
    ({"channels": 0}, r"channels and slices must be >= 1 \(got channels=0\)"),
    ({"slices": 2.0}, r"slices must be an integer, got 2.0"),
    ({"algorithm": "rign"}, r"unknown algorithm 'rign'"),
    ({"atom": "x"}, r"unknown atom 'x'"),
    ({"packed": "no"}, r"packed must be True or False, got 'no'"),
])
def test_a_groups_load_options_are_checked_when_it_is_made(options, message):
    """Their values waited for the group's first collective, where the names and trace did not."""
    with pytest.raises(PurlinError, match=message):
        _group(**options)


def test_load_tuned_refuses_the_pins_it_would_ignore(on_cuda0):
    """Its buckets pin the schedules: channels=4 (or a trace) was accepted and dropped."""
    from purlinc.runtime.loader import load_tuned
    from purlinc.runtime.options import LoadOptions

    for options, named in ((LoadOptions.of(channels=4), "channels"), (LoadOptions.of(trace=True), "trace"),
                           (LoadOptions.of(algorithm="ring", packed=False), "algorithm, packed")):
        with pytest.raises(PurlinError, match=rf"load_tuned takes params and arch only; {named} given"):
            load_tuned(EXAMPLES / "allreduce.pln", FakeComm(), options)


def test_a_call_of_part_rows_on_a_one_chunk_output_gets_no_note_about_chunks(on_cuda0):
    coll = load(FUSED, FakeComm(), params={"hidden": 64}, channels=1)
    with pytest.raises(ArgumentError) as info:
        coll(torch.ones(65), residual=torch.ones(65), weight=torch.ones(64), eps=1e-6)
    assert info.value.message.endswith("out has 65 elements per chunk, not a whole number of rows of 64 (the "
                                       "epilogue's rows(64))")
    assert info.value.notes == ()


def test_a_strided_tensor_is_refused_with_its_shape_and_strides(on_cuda0):
    """As purlinc.torch's refusal says them: 'x is not contiguous' alone left the caller to find which view."""
    coll = load(EXAMPLES / "allreduce.pln", FakeComm(), channels=1)
    with pytest.raises(ArgumentError, match=r"allreduce on rank 0: x is not contiguous \(shape \(4, 2\), strides "
                                            r"\(1, 4\)\)"):
        coll(torch.ones(2, 4).t(), torch.empty(8))


def test_a_groups_integer_options_may_be_numpy_integers():
    """Read as the pipeline reads them: the early check refused np.int64(4), which loads."""
    assert _group(channels=np.int64(4), slices=np.int32(2))
