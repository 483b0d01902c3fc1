"""The tma atom's shared-memory ring: sized per target, declared to the runtime through
KernelABI.shared_bytes, compiled without spills, and the SASS shows the pipelined datapath."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from purlinc import pipeline
from purlinc.atom import nvrtc
from purlinc.atom.atoms import ATOMS, parse_arch, tma_ring
from purlinc.atom.codegen import generate
from purlinc.dtypes import DType, ReduceOp
from test_nvrtc import _tool  # the one lookup of the NVIDIA wheels' binaries

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# Shared memory a block may opt in to (static + dynamic), from the CUDA programming guide.
MAX_SHARED = {"sm_90": 232448, "sm_100": 232448, "sm_120": 101376}


def _kernel(name: str, atom: str, arch: str, world_size: int = 2):
    definition = pipeline.parse_stage(pipeline.load_source(EXAMPLES / f"{name}.pln"))
    spec = pipeline.spec_stage(definition, world_size, None)
    schedule = pipeline.snac_stage(spec, pipeline.default_options(spec))
    op = ReduceOp.SUM if spec.is_reduce else None
    return generate(schedule, spec, atom=atom, arch=arch, dtype=DType.BFLOAT16, op=op)


def test_ring_sizes():
    for arch, limit in MAX_SHARED.items():
        ring = tma_ring(parse_arch(arch))
        assert ring.ring_bytes == ring.issuers * ring.stages * ring.tile_bytes
        assert ring.tile_bytes % 16 == 0 and 0 <= ring.pending < ring.stages
        assert ring.issuers * 32 <= 512
        assert ring.ring_bytes + 1024 + 1024 <= limit  # 1 KiB reserved per block, room for the barriers
    assert tma_ring(parse_arch("sm_90")).ring_bytes >= 192 * 1024


@pytest.mark.parametrize("arch", sorted(MAX_SHARED))
def test_abi_declares_the_ring(arch):
    tma = _kernel("allgather", "tma", arch)
    ring = tma_ring(parse_arch(arch))
    assert tma.abi.shared_bytes == ring.ring_bytes == ATOMS["tma"].shared_bytes(parse_arch(arch))
    assert tma.abi.to_json()["shared_bytes"] == ring.ring_bytes
    assert f"constexpr unsigned PURLIN_TMA_TILE = {ring.tile_bytes};" in tma.atom_source
    assert f"constexpr unsigned PURLIN_TMA_ISSUERS = {ring.issuers};" in tma.atom_source
    assert _kernel("allgather", "ldst", arch).abi.shared_bytes == 0


def _ptxas_log(source: str, filename: str, arch: str) -> str:
    lib = nvrtc._nvrtc()
    options = [o.encode() for o in (*nvrtc.normalize_options(arch), "--ptxas-options=-v")]
    program = nvrtc._call(lib.nvrtcCreateProgram, "nvrtcCreateProgram", source.encode(), filename.encode(), 0, [], [])
    try:
        (result,) = lib.nvrtcCompileProgram(program, len(options), options)
        log = nvrtc._program_log(lib, program)
        assert result == lib.nvrtcResult.NVRTC_SUCCESS, log
        return log
    finally:
        lib.nvrtcDestroyProgram(program)


@pytest.mark.parametrize("arch", sorted(MAX_SHARED))
@pytest.mark.parametrize("name", ["allgather", "allreduce"])
def test_no_spills_and_shared_memory_fits(name, arch):
    kernel = _kernel(name, "tma", arch)
    log = _ptxas_log(kernel.source, kernel.filename, arch)
    # ptxas -v: "Function properties for <f>" then ". N bytes stack frame, N bytes spill stores, ..."
    atom_functions = 0
    for function, frame in re.findall(r"Function properties for (\S+)\s*\n\s*ptxas\s*\.\s*(.*)", log):
        if "purlin_copy" in function or "purlin_tma" in function or "purlin_ldst" in function:
            atom_functions += 1
            assert "0 bytes spill stores, 0 bytes spill loads" in frame, (function, frame)
            assert frame.startswith("0 bytes stack frame"), (function, frame)
    assert atom_functions >= 3  # purlin_copy, purlin_tma_stream, purlin_ldst_copy
    static = [int(n) for n in re.findall(r"(\d+) bytes smem", log)]
    assert static and max(static) + kernel.abi.shared_bytes + 1024 <= MAX_SHARED[arch]  # 1 KiB reserved per block


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_sass_shows_the_pipeline(arch, tmp_path):
    cuobjdump, nvdisasm = _tool("cuobjdump"), _tool("nvdisasm")
    if cuobjdump is None or nvdisasm is None:
        pytest.skip("no disassembler: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm (the 'test' extra)")
    kernel = _kernel("alltoall", "tma", arch)
    path = tmp_path / "module.cubin"
    path.write_bytes(nvrtc.compile_cubin(kernel.source, kernel.filename, arch))
    env = dict(os.environ, PATH=f"{Path(nvdisasm).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    done = subprocess.run([cuobjdump, "-sass", str(path)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    sass = done.stdout
    assert "UBLKCP.S.G" in sass and "UBLKCP.G.S" in sass  # bulk loads into and stores out of the ring
    assert "SYNCS.ARRIVE.TRANS64" in sass and "TRYWAIT" in sass  # expect_tx and the phase waits
    pending = tma_ring(parse_arch(arch)).pending
    assert f"DEPBAR.LE SB0, 0x{pending:x}" in sass  # wait_group.read P before a slot is refilled
    assert "DEPBAR.LE SB0, 0x0" in sass  # wait_group 0 before returning


def _issuer_trace(bytes_: int, w: int, issuers: int, stages: int, pending: int, tile: int):
    """A line-by-line Python transcription of purlin_tma_stream's loops (keep in step with the
    template): the events of issuer w, for the invariants below."""
    tiles = -(-bytes_ // tile)
    count = -(-(tiles - w) // issuers) if tiles > w else 0
    events = []
    span = lambda k: ((w + k * issuers) * tile, min(tile, bytes_ - (w + k * issuers) * tile))
    for k in range(min(count, stages)):
        events.append(("load", k, k % stages) + span(k))
    for k in range(count):
        events.append(("wait", k, k % stages, (k // stages) & 1))
        events.append(("store", k, k % stages) + span(k))
        if k >= pending and k - pending + stages < count:
            events.append(("read", pending))
            nxt = k - pending + stages
            events.append(("load", nxt, nxt % stages) + span(nxt))
    return events


@pytest.mark.parametrize("ring", [tma_ring(parse_arch("sm_90")), tma_ring(parse_arch("sm_120"))])
def test_issuer_schedule_invariants(ring):
    """Every byte of the body moved exactly once; a slot is loaded only after the previous
    tile in it was waited for and its store is outside the P newest groups; each barrier is
    waited once per load, with the parity of its use count."""
    issuers, stages, pending, tile = ring.issuers, ring.stages, ring.pending, ring.tile_bytes
    for bytes_ in (16, tile - 16, tile, tile + 16, 3 * tile, issuers * tile + 48, 64 * 1024,
                   issuers * stages * tile * 5 + 4096, 1 << 22):
        covered = []
        for w in range(issuers):
            stores = []  # store tile k, in commit order
            loads_into = {s: [] for s in range(stages)}  # slot -> tiles loaded, in order
            waited = set()
            read_done = set()  # stores known to have read their slot (wait_group.read)
            arrivals = [0] * stages  # phases started on each barrier
            for event in _issuer_trace(bytes_, w, issuers, stages, pending, tile):
                kind = event[0]
                if kind == "load":
                    _, k, s, at, n = event
                    assert n > 0 and n % 16 == 0 and at % 16 == 0
                    if loads_into[s]:
                        prev = loads_into[s][-1]
                        assert prev in waited  # barrier phase of the previous tile completed and observed
                        assert prev in read_done  # its store has read the slot
                    loads_into[s].append(k)
                    arrivals[s] += 1
                elif kind == "wait":
                    _, k, s, parity = event
                    assert loads_into[s] and loads_into[s][-1] == k  # the newest phase of barrier s is tile k's
                    assert parity == (arrivals[s] - 1) & 1
                    waited.add(k)
                elif kind == "store":
                    _, k, s, at, n = event
                    assert k in waited
                    stores.append(k)
                    covered.append((at, n))
                elif kind == "read":
                    read_done = set(stores[: max(0, len(stores) - event[1])])
            assert sorted(waited) == list(range(len(waited)))
        covered.sort()
        assert covered[0][0] == 0 and sum(n for _, n in covered) == bytes_
        assert all(a + n == b for (a, n), (b, _) in zip(covered, covered[1:]))
