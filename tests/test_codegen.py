"""CUDA generation (purlinc.atom.codegen): structure of the generated module, the split
between orchestration and atom, names, comments, and the errors it raises.  CPU only;
compiling is tests/test_nvrtc.py's job."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from purlinc import pipeline
from purlinc.atom.codegen import fuse, limits, render
from purlinc.atom.abi import HEADER_FIELDS, KernelABI, StagingPlacement
from purlinc.atom.atoms import applicable_atoms, get_atom, parse_arch
from purlinc.atom.codegen import generate
from purlinc.atom.nvrtc import compile_cubin
from purlinc.dtypes import DType, ReduceOp
from purlinc.errors import InternalError, PurlinError
from purlinc.frontend.ast import Operation
from purlinc.snac.ir import (
    Algorithm, Consume, LowerOptions, Notify, Program, Region, Role, Schedule, Signal, SignalDecl, Space,
    Stage, Wait,
)
from purlinc.snac.lower import applicable_algorithms

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
EXAMPLE_NAMES = sorted(p.stem for p in EXAMPLES.glob("*.pln"))


def spec_of(name: str, world_size: int):
    definition = pipeline.parse_stage(pipeline.load_source(EXAMPLES / f"{name}.pln"))
    return pipeline.spec_stage(definition, world_size, None)


def schedule_of(name: str, world_size: int = 4, algorithm: Algorithm | None = None, **changes):
    spec = spec_of(name, world_size)
    options = pipeline.default_options(spec)
    if algorithm is not None:
        changes["algorithm"] = algorithm
    return spec, pipeline.snac_stage(spec, replace(options, **changes))


def op_for(spec) -> ReduceOp | None:
    return ReduceOp.SUM if spec.is_reduce else None


def rank_text(source: str, rank: int) -> str:
    """The text of the body ``rank`` runs (from its banner to the next one)."""
    for part in re.split(r"(?m)^// ==== ", source)[1:]:
        ranks = re.match(r"ranks? ([0-9, ]+):", part)
        if ranks and rank in [int(r) for r in ranks.group(1).split(",")]:
            return part
    raise AssertionError(f"no body runs rank {rank}")


def rank_code(schedule, rank: int) -> str:
    """``rank``'s own blocks, every number written out: the shared code expanded with its row of
    the table (what tests/test_codegen_tables.py proves equal to the rank's blocks)."""
    import sys

    _, module = sys.modules["purlinc.atom.codegen.generate"].bodies_of(schedule)
    body = next(b for b in module if rank in b.ranks)
    row = body.rows[body.ranks.index(rank)]
    return "".join(text for item in body.items for text in item.expand(row))


# ---- a hand-built schedule: merged groups, a hazard barrier, a cross-call wait ----------

def _r(space: Space, rank: int, unit: int) -> Region:
    return Region(space, rank, unit, 0)


def hand_schedule() -> Schedule:
    """Two ranks, one channel.  Rank 0 pushes two units to rank 1 and raises both signals
    at once; rank 1 waits for both at once.  Rank 0 then copies into OUT and out of OUT
    again (needs a barrier between the two)."""
    data0, data1, ack = Signal(1, 0), Signal(1, 1), Signal(0, 0)
    rank0 = (
        Wait(ack, 0, note="rank 1 done with the previous call"),
        Stage(_r(Space.IN, 0, 0), _r(Space.STAGE, 1, 0), note="x for r1"),
        Stage(_r(Space.IN, 0, 0), _r(Space.STAGE, 1, 1), note="x again"),
        Notify(data0, 1),
        Notify(data1, 1),
        Consume(Operation.COPY, (_r(Space.IN, 0, 0),), _r(Space.OUT, 0, 0), line=3),
        Consume(Operation.COPY, (_r(Space.OUT, 0, 0),), _r(Space.OUT, 0, 1), line=3),
    )
    rank1 = (
        Wait(data0, 1),
        Wait(data1, 1),
        Consume(Operation.COPY, (_r(Space.STAGE, 1, 0),), _r(Space.OUT, 1, 0), line=3),
        Consume(Operation.COPY, (_r(Space.STAGE, 1, 1),), _r(Space.OUT, 1, 1), line=3),
        Notify(ack, 1),
    )
    return Schedule(
        collective="handmade", world_size=2, operation=Operation.COPY, options=LowerOptions(), slices=1,
        in_units=(1, 1), out_units=(2, 2), stage_units=2,
        signals=(
            SignalDecl(data0, 1, Role.DATA), SignalDecl(data1, 1, Role.DATA), SignalDecl(ack, 1, Role.ACK),
        ),
        programs=(Program(0, 0, rank0), Program(1, 0, rank1)),
        channel_signals=2,
    )


def test_hand_schedule_structure():
    kernel = generate(hand_schedule(), None, atom="ldst", arch="sm_90", dtype=DType.FLOAT32, op=None)
    r0, r1 = rank_text(kernel.source, 0), rank_text(kernel.source, 1)
    # merged notify: one barrier, two lanes raise the two signals
    assert "if (threadIdx.x < 2) {  // lane i raises the i-th signal" in r0
    assert "args.signals[1] + sig0 + 0" in r0 and "args.signals[1] + sig0 + 1" in r0
    # merged wait: two lanes poll, one barrier tells everyone
    assert "if (threadIdx.x < 2) {  // lane i polls the i-th signal" in r1
    assert r1.count("__syncthreads_or") == 1
    # steps 1, 2 and 5 copy in[0]: one copy to three destinations, step 5 moved above the
    # notifies (remote destinations first, in step order)
    assert re.search(r"// step 1:.*\n\s*// step 2:.*\n\s*// step 5:.*\n\s*// steps above: one copy to 3 destinations", r0)
    assert "purlin_copy_multi<3>(dsts, purlin_region(args, rd, 0, 0, 0, slice0 + 0)" in r0  # kind 0: own IN
    assert r0.index("dsts.p[2] = purlin_region(args, rd, 1, 0, 0, slice0 + 0)") < r0.index("// step 3: notify")
    # step 6 reads what step 5 wrote: a barrier in between
    assert re.search(r"// barrier: step 6 .*\n\s*__syncthreads\(\);\n\s*// step 6:", r0)
    # a cross-call wait: epoch * 1 + (0)
    assert "(purlin_i64)rd.epoch * 1 + (0)" in r0
    # every step is named in a comment, with its note or line
    for rank, steps in ((0, 7), (1, 5)):
        text = rank_text(kernel.source, rank)
        for index in range(steps):
            assert f"// step {index}: " in text
    assert "(x for r1)" in r0 and "(line 3)" in r0


@pytest.mark.parametrize("name", ("allgather", "allreduce"))
def test_channels_are_indexed_not_enumerated(name):
    """One body per rank whatever the channel count: channel c = blockIdx.x picks slices
    c*S.. and signals c*W..; the source differs across channel counts only in constants."""
    sources = {}
    for channels in (1, 4, 128):
        spec, schedule = schedule_of(name, 4, channels=channels, slices=2)
        kernel = generate(schedule, spec, atom="ldst", arch="sm_90", dtype=DType.FLOAT32,
                          op=ReduceOp.SUM if spec.is_reduce else None)
        source = kernel.source
        assert "switch (blockIdx.x)" not in source and source.count("__global__") == 1  # one body, all ranks
        assert "const unsigned slice0 = blockIdx.x * PURLIN_CHANNEL_SLICES;" in source
        assert "const unsigned sig0 = blockIdx.x * PURLIN_CHANNEL_SIGNALS;" in source
        assert f"constexpr unsigned PURLIN_CHANNEL_SIGNALS = {schedule.channel_signals};" in source
        assert kernel.abi.channels == channels and kernel.abi.signal_pad == channels * schedule.channel_signals
        sources[channels] = source
    assert len(sources[128]) <= 1.01 * len(sources[1])
    body = rank_text(sources[128], 1)
    assert re.search(r"purlin_region\(args, rd, 4, [^,]+, [^,]+, slice0 \+ 1\)", body)  # 4: staging
    assert re.search(r"args\.signals\[(tab\[\d+\]|\d)\] \+ sig0 \+ ", body)


def test_runs_of_like_steps_become_loops():
    """allreduce R=8, direct-push: one body for every rank; each rank stages its 8 units to its
    7 peers as one loop over a table (56 copies), and reduces its 8 units in another; every step
    of rank 0 keeps its comment, and each rank's loop rows are exactly its own steps."""
    spec, schedule = schedule_of("allreduce", 8)
    kernel = generate(schedule, spec, atom="ldst", arch="sm_90", dtype=DType.FLOAT32, op=ReduceOp.SUM)
    body = rank_text(kernel.source, 0)
    for index in range(len(schedule.programs[0].steps)):
        assert f"// step {index}: " in body
    assert re.findall(r"for \(int t = 0; t < (\d+); \+\+t\)", body) == ["56", "8"]
    assert "purlin_reduce<8>(purlin_region(args, rd, 1, tab[" in body  # OUT, unit t
    code = rank_code(schedule, 0)
    assert "purlin_copy(purlin_region(args, rd, 4, 1, 0, slice0 + 0), purlin_region(args, rd, 0, 0, 0, slice0 + 0)" in code
    assert "purlin_copy(purlin_region(args, rd, 4, 7, 7, slice0 + 0), purlin_region(args, rd, 0, 0, 7, slice0 + 0)" in code
    # the 8 reductions: in[u] (kind 0), then the 7 peers' staged units u, 8 + u, ... (kind 4)
    assert "purlin_region(args, rd, 0, 0, 0, slice0 + 0),\n                purlin_region(args, rd, 4, 0, 0, slice0 + 0)," in code
    assert "purlin_region(args, rd, 4, 0, 55, slice0 + 0)," in code


def test_a_body_too_large_to_compile_is_refused_at_once():
    """Each slice's steps are code of their own: allreduce R=3 at 256 slices per channel made a
    body NVRTC took minutes over (109 s; with an epilogue, past 15 minutes).  The generator
    refuses it before any NVRTC call; 64 slices (a body of 513) is generated."""
    spec, schedule = schedule_of("allreduce", 3, slices=256)
    with pytest.raises(PurlinError) as info:
        generate(schedule, spec, atom="ldst", arch="sm_90", dtype=DType.FLOAT32, op=ReduceOp.SUM)
    assert re.match(r"allreduce for R=3 \(direct-push, 256 slice\(s\) per channel\): its kernel body would hold "
                    rf"2,0\d\d blocks and operands, and a generated function holds at most {limits.MAX_BODY_SIZE:,} ",
                    info.value.message), info.value.message
    assert "use fewer slices" in info.value.notes[0]
    spec, schedule = schedule_of("allreduce", 3, slices=64)
    generate(schedule, spec, atom="ldst", arch="sm_90", dtype=DType.FLOAT32, op=ReduceOp.SUM)


def _copy_block(src: Region, dst: Region) -> dict:
    return {"kind": "copy", "comments": [f"step {dst.unit}: copy"], "dst": dst.format(), "srcs": [src.format()],
            "slice": "s", "regions": (dst, src), "reads": frozenset({src}), "writes": frozenset({dst})}


def test_copies_of_one_source_fuse():
    """Copies of one region fuse into one multi-destination copy, moving above notifies only;
    a wait, a barrier, another source or a hazard keeps them apart."""
    x, y = _r(Space.IN, 0, 0), _r(Space.IN, 0, 1)
    peer, peer2, own = _r(Space.STAGE, 1, 0), _r(Space.STAGE, 1, 1), _r(Space.OUT, 0, 0)
    notify = {"kind": "notify_one", "comments": ["step 9: notify"]}
    fused = fuse.fuse_copies([_copy_block(x, peer), _copy_block(x, peer2), notify, _copy_block(x, own)])
    assert [b["kind"] for b in fused] == ["copy_multi", "notify_one"]
    assert fused[0]["dsts"] == [peer.format(), peer2.format(), own.format()]
    assert fused[0]["writes"] == {peer, peer2, own} and fused[0]["reads"] == {x}
    assert "moved above the 1 notify block(s)" in fused[0]["comments"][-1]
    for between in ({"kind": "wait_one", "comments": []}, {"kind": "barrier", "comments": []}):
        kept = fuse.fuse_copies([_copy_block(x, peer), between, _copy_block(x, own)])
        assert [b["kind"] for b in kept] == ["copy", between["kind"], "copy"]
    assert [b["kind"] for b in fuse.fuse_copies([_copy_block(x, peer), _copy_block(y, own)])] == ["copy", "copy"]
    # a copy writing the fused copy's source (or a destination) stays separate
    assert [b["kind"] for b in fuse.fuse_copies([_copy_block(x, peer), _copy_block(x, peer)])] == ["copy", "copy"]
    many = fuse.fuse_copies([_copy_block(x, _r(Space.STAGE, 1, u)) for u in range(limits.MAX_COPY_DSTS + 2)])
    assert [len(b.get("dsts", [0])) for b in many] == [limits.MAX_COPY_DSTS, 2]  # the ninth starts another


@pytest.mark.parametrize("name", ["allgather", "broadcast"])
def test_multi_destination_copy_compiles(name):
    """all-gather R=4 reads its input once for three peers and its own output; both kernel
    atoms implement the copy (their orchestration is the same text)."""
    spec, schedule = schedule_of(name, 4)
    texts = {}
    for atom in ("ldst", "tma"):
        kernel = generate(schedule, spec, atom=atom, arch="sm_90", dtype=DType.BFLOAT16, op=None)
        texts[atom] = kernel.orchestration_source
        compile_cubin(kernel.source, kernel.filename, "sm_90")
    assert "purlin_copy_multi<4>(dsts, purlin_region(args, rd, 0, " in rank_code(schedule, 0)
    assert texts["ldst"] == texts["tma"]

def test_entry_points_and_abi():
    spec, schedule = schedule_of("allgather", 4)
    kernel = generate(schedule, spec, atom="ldst", arch="sm_90", dtype=DType.BFLOAT16, op=None)
    assert re.fullmatch(r"purlin_allgather_[0-9a-f]{8}", kernel.kernel_base)
    assert kernel.filename == f"{kernel.kernel_base}.cu"
    abi = kernel.abi
    assert abi.bodies == (0, 0, 0, 0)  # every rank runs body 0
    for rank in range(4):
        assert abi.entry(rank) == f"{kernel.kernel_base}_b0"
        assert f"extern \"C\" __global__ void __launch_bounds__({limits.THREADS})\n{abi.entry(rank)}(const purlin_args args)" in kernel.source
    assert kernel.source.count('extern "C" __global__') == 1
    assert (abi.world_size, abi.channels, abi.threads, abi.itemsize) == (4, schedule.channels, limits.THREADS, 2)
    assert abi.stage_units == schedule.stage_units and abi.signal_pad == schedule.signal_pad_size()
    assert abi.in_units == schedule.in_units and abi.out_units == schedule.out_units
    assert not abi.needs_in_peers and not abi.needs_out_peers


def test_args_struct_matches_abi():
    spec, schedule = schedule_of("allreduce", 8)
    kernel = generate(schedule, spec, atom="ldst", arch="sm_80", dtype=DType.FLOAT32, op=ReduceOp.SUM)
    body = re.search(r"struct purlin_args \{(.*?)\n\};", kernel.source, re.S).group(1)
    names = re.findall(r"^\s+[\w\s\*]+?\*?\s*(\w+)(?:\[PURLIN_WORLD\])?;", body, re.M)
    assert names == [*HEADER_FIELDS, "stage", "signals", "in_peer", "out_peer"]
    assert "constexpr int PURLIN_WORLD = 8;" in kernel.source


def _abi(itemsize: int, stage_units: int, slices: int, copies: int, align: int) -> KernelABI:
    return KernelABI(kernel_base="k", world_size=2, channels=1, threads=256, shared_bytes=0, itemsize=itemsize,
                     stage_units=stage_units * copies, slices=slices, stage_copies=copies, signal_pad=1,
                     in_units=(1, 1), out_units=(1, 1), needs_in_peers=False, needs_out_peers=False,
                     stage_align=align)


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("slices", [1, 3, 8])
@pytest.mark.parametrize("copies,align", [(1, 1), (2, 16)])
def test_header_geometry_is_the_simulators(itemsize, slices, copies, align):
    """What the kernel computes from the host's header (prelude.cuh: purlin_round_geometry,
    purlin_slice_lo / _len, purlin_io, purlin_stage) gives the simulator's slice bounds in
    every round, and the staging offsets the runtime allocated."""
    from purlinc.runtime.validate import rounds as runtime_rounds
    from purlinc.snac.simulate import round_slice_bounds

    abi = _abi(itemsize, 3, slices, copies, align)
    # the largest piece's slices fit (5000 elements in up to 8 slices of 16-byte multiples)
    staging = StagingPlacement.for_space(3 * copies * 8 * (5000 * itemsize // slices + 32), 3 * copies, slices)
    for count in (0, 1, 5, 7, 64, 100, 1000, 4099):
        for piece in (1, 3, 16, 64, 1000, 5000):
            rounds, io_unit, piece_bytes, last_bytes, unit, step, copy_bytes, stage_step = abi.geometry(
                count, piece, staging)
            assert rounds == runtime_rounds(count, piece) and io_unit == count * itemsize
            assert (unit, stage_step) == abi.staged_at(piece, staging)[1:]
            assert step <= stage_step and slices * stage_step <= unit  # every slice fits its fixed place
            assert copy_bytes == (3 * unit if copies == 2 else 0)
            for r in range(rounds):
                nbytes = last_bytes if r + 1 == rounds else piece_bytes  # rd.bytes
                n_round = min(piece, count - r * piece)
                assert nbytes == n_round * itemsize and r * piece_bytes == r * piece * itemsize  # rd.io_offset
                for s in range(slices):
                    lo = min(s * step, nbytes)
                    hi = min(lo + step, nbytes)
                    want = round_slice_bounds(piece, n_round, itemsize, slices, s)
                    assert (lo, hi) == (want[0] * itemsize, want[1] * itemsize), (count, piece, r, s)
    with pytest.raises(ValueError, match="piece=0"):
        abi.geometry(10, 0, staging)


def test_epoch_is_set_where_first_needed():
    # A plain program sets its round's epoch before its first block; a packed one after its
    # first send's loads (tests/test_packed.py: test_generated_ll_structure).
    spec, schedule = schedule_of("allreduce", 2)
    kernel = generate(schedule, spec, atom="ldst", arch="sm_90", dtype=DType.BFLOAT16, op=ReduceOp.SUM)
    for rank in range(2):
        body = rank_text(kernel.source, rank)
        assert body.count("purlin_round_epoch(rd, args, epoch0 + round);") == 1
        assert body.index("purlin_round_geometry<Geo>(") < body.index("purlin_round_epoch(") < body.index("// step 0")


def test_registered_buffers_need_peers():
    spec, schedule = schedule_of("allgather", 4, Algorithm.DIRECT_PULL, registered=frozenset({"in"}))
    kernel = generate(schedule, spec, atom="ldst", arch="sm_90", dtype=DType.BFLOAT16, op=None)
    assert kernel.abi.needs_in_peers
    assert "purlin_region(args, rd, 2, " in rank_code(schedule, 0)  # 2: a peer's registered IN


def test_names_are_deterministic_and_distinct():
    spec, schedule = schedule_of("allreduce", 4)
    a = generate(schedule, spec, atom="ldst", arch="sm_90", dtype=DType.BFLOAT16, op=ReduceOp.SUM)
    b = generate(schedule, spec, atom="ldst", arch="sm_90", dtype=DType.BFLOAT16, op=ReduceOp.SUM)
    assert a.source == b.source and a.kernel_base == b.kernel_base
    others = {
        generate(schedule, spec, atom="ldst", arch="sm_90", dtype=DType.FLOAT32, op=ReduceOp.SUM).kernel_base,
        generate(schedule, spec, atom="ldst", arch="sm_90", dtype=DType.BFLOAT16, op=ReduceOp.MAX).kernel_base,
        generate(schedule, spec, atom="tma", arch="sm_90", dtype=DType.BFLOAT16, op=ReduceOp.SUM).kernel_base,
    }
    assert a.kernel_base not in others and len(others) == 3
    # the target is not part of the name: sm_90 and sm_100 share the source
    c = generate(schedule, spec, atom="ldst", arch="sm_100", dtype=DType.BFLOAT16, op=ReduceOp.SUM)
    assert c.source == a.source


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_atoms_change_only_the_atom_part(name):
    """The same schedule generated for ldst and tma differs only between the atom markers."""
    for world_size in (2, 8):
        spec = spec_of(name, world_size)
        for algorithm in applicable_algorithms(spec):
            schedule = pipeline.snac_stage(spec, replace(pipeline.default_options(spec), algorithm=algorithm))
            ldst, tma = (
                generate(schedule, spec, atom=atom, arch="sm_90", dtype=DType.BFLOAT16, op=op_for(spec))
                for atom in ("ldst", "tma")
            )
            assert ldst.orchestration_source == tma.orchestration_source, (name, world_size, algorithm)
            assert ldst.atom_source != tma.atom_source
            for kernel in (ldst, tma):
                # the atom knows nothing of signals or schedules; the orchestration nothing of datapaths
                assert "purlin_notify" not in kernel.atom_source and "purlin_wait" not in kernel.atom_source
                assert "cp.async" not in kernel.orchestration_source and "uint4" not in kernel.orchestration_source
            assert "cp.async.bulk" in tma.atom_source and "cp.async" not in ldst.atom_source


def test_reduce_elements_and_ops():
    spec, schedule = schedule_of("reduce_scatter", 4)
    for dtype, op, names in (
        (DType.BFLOAT16, ReduceOp.SUM, ("purlin_bf16_to_acc", "purlin_acc_to_bf16", "purlin_sum_f")),
        (DType.FLOAT16, ReduceOp.MAX, ("purlin_f16_to_acc", "purlin_acc_to_f16", "purlin_max_f")),
        (DType.FLOAT32, ReduceOp.PROD, ("purlin_f32_to_acc", "purlin_acc_to_f32", "purlin_prod_f")),
        (DType.INT32, ReduceOp.MIN, ("purlin_i32_to_acc", "purlin_acc_to_i32", "purlin_min_i")),
    ):
        source = generate(schedule, spec, atom="ldst", arch="sm_90", dtype=dtype, op=op).source
        for name in names:
            assert f"return {name}(" in source
        assert "purlin_reduce<" in source
        assert "#include" not in source  # no NVRTC headers needed


def test_copy_ignores_op_and_allows_fp8():
    spec, schedule = schedule_of("allgather", 2)
    a = generate(schedule, spec, atom="ldst", arch="sm_90", dtype=DType.FLOAT8_E4M3, op=ReduceOp.SUM)
    b = generate(schedule, spec, atom="ldst", arch="sm_90", dtype=DType.FLOAT8_E4M3, op=None)
    assert a.op is None and a.source == b.source
    assert "purlin_reduce" not in a.source


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(atom="tma", arch="sm_80"), "atom 'tma' needs sm_90 or newer, not sm_80"),
        (dict(atom="ldst", arch="sm_75"), "unknown target architecture 'sm_75'"),
        (dict(atom="ldst", arch="compute_90"), "unknown target architecture 'compute_90'"),
        (dict(atom="ldst", arch="sm90"), "unknown target architecture 'sm90'"),
        (dict(atom="multimem", arch="sm_90"), "unknown atom 'multimem'"),
        (dict(atom="ldst", arch="sm_90", dtype=DType.FLOAT8_E5M2), "float8_e5m2 cannot be reduced"),
        (dict(atom="ldst", arch="sm_90", op=None), "allreduce is a reduction: give an operator"),
    ],
)
def test_errors(kwargs, message):
    spec, schedule = schedule_of("allreduce", 2)
    values = dict(dtype=DType.BFLOAT16, op=ReduceOp.SUM) | kwargs
    with pytest.raises(PurlinError) as error:
        generate(schedule, spec, **values)
    assert message in error.value.render()


def test_atom_registry():
    assert applicable_atoms("sm_80") == ("ldst",)
    assert applicable_atoms("sm_90") == ("ldst", "tma")
    assert applicable_atoms("sm_100a") == ("ldst", "tma")
    assert parse_arch("sm_90a").name == "sm_90a"
    assert get_atom("tma", "sm_100").template == "atom_tma.cuh.j2"


@pytest.mark.parametrize("arch, accepted", [
    ("sm_90a", True), ("sm_100a", True), ("sm_120a", True), ("sm_100f", True), ("sm_121f", True),
    ("sm_80a", False), ("sm_86a", False), ("sm_89a", False), ("sm_80f", False), ("sm_87f", False), ("sm_90f", False),
])
def test_arch_suffixes_are_those_nvrtc_knows(arch, accepted):
    """'a' exists from sm_90, 'f' from sm_100: a target NVRTC would refuse is refused by name."""
    if accepted:
        assert parse_arch(arch).name == arch
        return
    with pytest.raises(PurlinError) as error:
        parse_arch(arch)
    assert f"unknown target architecture {arch!r}" in error.value.render()


def test_missing_template_value_is_an_error():
    with pytest.raises(InternalError, match="has no attribute 'srcs'"):  # a bug, not the user's input
        render.render("block_copy.cu.j2", block={"dst": "d", "loop": 0})


def test_broken_template_is_a_readable_error(monkeypatch):
    real = render.load_template

    def broken(name):
        text = real(name)
        return text.replace("{% for body in bodies %}", "{% for body in bodies") if name == "kernel.cu.j2" else text

    render.environment.cache_clear()
    monkeypatch.setattr(render, "load_template", broken)
    try:
        spec, schedule = schedule_of("allgather", 2)
        with pytest.raises(InternalError) as error:  # a bug, not the user's input
            generate(schedule, spec, atom="ldst", arch="sm_90", dtype=DType.BFLOAT16, op=None)
        assert re.match(r"template kernel\.cu\.j2:\d+: ", str(error.value))
    finally:
        monkeypatch.undo()
        render.environment.cache_clear()


def test_dump_cuda_stage(capsys):
    from purlinc.cli import main

    assert main(["dump", str(EXAMPLES / "allgather.pln"), "--ranks", "2", "--stage", "cuda", "--atom", "tma"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("// purlin_allgather_") and "atom 'tma'" in out


def test_parameters_that_lower_alike_still_name_their_own_kernels():
    """The source names the bound parameters: two values with one schedule wrote one set of
    files, the second compile's manifest naming its value over the first's."""
    from purlinc import pipeline

    text = "collective noop_param(k = 1) { in[r] = x[r]  out[r] = x[0..R]  copy }\n"
    one, two = (pipeline.compile(pipeline.SourceText(text, "n.pln"), world_size=2, params={"k": k}, emit_cubin=False)
                for k in (1, 2))
    assert one.schedule.programs == two.schedule.programs
    assert one.cuda.kernel_base != two.cuda.kernel_base
