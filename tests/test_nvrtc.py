"""NVRTC: every example x applicable algorithm x atom x target x R in {2, 4, 8} compiles to
a CUBIN; errors are readable; the disk cache works; the SASS shows the datapath we meant.

The matrix is compiled once per session by a process pool (one worker per core) into a
session-scoped cache directory, for the cases the session selected; each case is then its
own test.

The full matrix (615 modules) takes about 12 CPU-minutes: R=8 ring schedules are ~100 steps
per rank and ptxas compiles every rank's entry separately.  The default run (``pytest``,
which deselects ``slow``) compiles every example x algorithm (and LL packing) once at R=2,
rotating over the (arch, atom) targets so that every target compiles several modules of
every atom it supports, plus one R=8 module per atom.  The rest is marked ``slow``:
``pytest -m slow tests/test_nvrtc.py`` compiles it, ``pytest -m "slow or not slow"`` all."""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from purlinc import pipeline
from purlinc.atom import nvrtc
from purlinc.log import log as purlin_log
from purlinc.atom.atoms import applicable_atoms
from purlinc.atom.codegen import generate
from purlinc.dtypes import DType, ReduceOp
from purlinc.errors import PurlinError
from purlinc.snac.ir import Algorithm
from purlinc.snac.lower import applicable_algorithms

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ARCHES = ("sm_80", "sm_90", "sm_100")
WORLD_SIZES = (2, 4, 8)
PACKED = "direct-push+ll"  # direct-push with packed (LL) stages
# dtypes / ops rotate over the cases, so the matrix covers each without multiplying it.
COPY_TYPES = (DType.BFLOAT16, DType.FLOAT32, DType.FLOAT8_E4M3, DType.FLOAT16, DType.INT32, DType.INT64)
REDUCE_TYPES = (
    (DType.BFLOAT16, ReduceOp.SUM), (DType.FLOAT32, ReduceOp.MAX), (DType.FLOAT16, ReduceOp.SUM),
    (DType.INT32, ReduceOp.PROD), (DType.BFLOAT16, ReduceOp.MIN), (DType.FLOAT32, ReduceOp.SUM),
    (DType.INT64, ReduceOp.SUM),
)


def _spec(name: str, world_size: int):
    definition = pipeline.parse_stage(pipeline.load_source(EXAMPLES / f"{name}.pln"))
    return pipeline.spec_stage(definition, world_size, None)


TARGETS = tuple((arch, atom) for arch in ARCHES for atom in applicable_atoms(arch))


def _cases() -> list[tuple]:
    cases = []
    for path in sorted(EXAMPLES.glob("*.pln")):
        for world_size in WORLD_SIZES:
            spec = _spec(path.stem, world_size)
            algorithms = [a.value for a in applicable_algorithms(spec)]
            if world_size == WORLD_SIZES[0]:
                algorithms.append(PACKED)  # LL packing: every target, at R=2 only
            for algorithm in algorithms:
                for arch, atom in TARGETS:
                    n = len(cases)
                    if spec.is_reduce:
                        dtype, op = REDUCE_TYPES[n % len(REDUCE_TYPES)]
                    else:
                        dtype, op = COPY_TYPES[n % len(COPY_TYPES)], None
                    cases.append((path.stem, world_size, algorithm, arch, atom, dtype.value, op and op.value))
    return cases


def _default_cases(cases: list[tuple]) -> set[tuple]:
    """What the default run compiles: each (example, algorithm) at R=2 on one target, the
    targets taken in turn; and at R=8 one module per atom (allreduce's ring: the largest)."""
    chosen, rotation = set(), 0
    for case in cases:
        name, world_size, algorithm, arch, atom = case[:5]
        if world_size == WORLD_SIZES[0] and (arch, atom) == TARGETS[rotation % len(TARGETS)]:
            chosen.add(case)
        if world_size == WORLD_SIZES[0] and (arch, atom) == TARGETS[-1]:
            rotation += 1  # the next (example, algorithm) takes the next target
    for atom, arch in (("ldst", "sm_90"), ("tma", "sm_100")):
        chosen.update(c for c in cases if c[:5] == ("allreduce", WORLD_SIZES[-1], "ring", arch, atom))
    for dtype, op in ((d.value, None) for d in COPY_TYPES):  # every dtype and op compiles at least once
        if not any(c[5:] == (dtype, op) for c in chosen):
            chosen.add(next(c for c in cases if c[5:] == (dtype, op) and c[1] == WORLD_SIZES[0]))
    for dtype, op in ((d.value, o.value) for d, o in REDUCE_TYPES):
        if not any(c[5:] == (dtype, op) for c in chosen):
            chosen.add(next(c for c in cases if c[5:] == (dtype, op) and c[1] == WORLD_SIZES[0]))
    return chosen


CASES = _cases()
DEFAULT_CASES = _default_cases(CASES)


def _case_id(case) -> str:
    name, world_size, algorithm, arch, atom, dtype, op = case
    return f"{name}-R{world_size}-{algorithm}-{arch}-{atom}-{dtype}" + (f"-{op}" if op else "")


class _NvrtcLog(logging.Handler):
    """What NVRTC said about the compiles made while it is attached (nvrtc.py logs a
    successful compile's warnings at DEBUG)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record) -> None:
        self.lines += [line for line in record.getMessage().splitlines() if "warning" in line]

    def __enter__(self):
        self.level = purlin_log.level
        purlin_log.addHandler(self)
        purlin_log.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc) -> None:
        purlin_log.removeHandler(self)
        purlin_log.setLevel(self.level)


def _compile_case(case) -> tuple:
    """Worker: (case, error text or None, entry names, cubin bytes); NVRTC's warnings are an
    error too: a narrowing one is ill-formed C++ that another compiler version may refuse."""
    name, world_size, algorithm, arch, atom, dtype, op = case
    try:
        spec = _spec(name, world_size)
        packed = algorithm == PACKED
        options = replace(pipeline.default_options(spec), algorithm=Algorithm(algorithm.removesuffix("+ll")), packed=packed)
        schedule = pipeline.snac_stage(spec, options)
        kernel = generate(schedule, spec, atom=atom, arch=arch, dtype=DType(dtype), op=op and ReduceOp(op))
        with _NvrtcLog() as warnings:
            cubin = nvrtc.compile_cubin(kernel.source, kernel.filename, arch)
        if warnings.lines:
            return case, "NVRTC warned:\n" + "\n".join(warnings.lines[:10]), [], b""
        entries = [kernel.abi.entry(rank) for rank in range(world_size)]
        if kernel.abi.lean:  # packed modules: each rank's lean entry too (abi.KernelABI.lean_entry)
            entries += [kernel.abi.lean_entry(rank) for rank in range(world_size)]
        return case, None, entries, cubin
    except Exception as error:  # noqa: BLE001 - reported by the test of this case
        return case, f"{type(error).__name__}: {error}", [], b""


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """A fresh compile cache for the whole session (children of the pool inherit it)."""
    path = tmp_path_factory.mktemp("purlin-cache")
    saved = {k: os.environ.get(k) for k in ("PURLIN_CACHE_DIR", "PURLIN_NO_CACHE")}
    os.environ["PURLIN_CACHE_DIR"] = str(path)
    os.environ.pop("PURLIN_NO_CACHE", None)
    yield path
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def matrix(cache_dir, request):
    workers = max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 16))
    # Only the cases this session selected (-m, -k, node ids).
    selected = {item.callspec.params["case"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_compiles" and hasattr(item, "callspec")}
    # fork: the children inherit this module and the environment; NVRTC keeps no state
    # that forking would break.  Biggest modules first, so the pool ends evenly.
    order = sorted(selected, key=lambda c: (-c[1], c[2] != "ring"))
    if workers == 1 or sys.platform != "linux":
        results = [_compile_case(case) for case in order]
    else:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            results = pool.map(_compile_case, order, chunksize=1)
    return {case: (error, entries, cubin) for case, error, entries, cubin in results}


@pytest.mark.parametrize("case", [
    pytest.param(c, id=_case_id(c), marks=() if c in DEFAULT_CASES else (pytest.mark.slow,)) for c in CASES
])
def test_compiles(case, matrix):
    error, entries, cubin = matrix[case]
    assert error is None, error
    assert cubin[:4] == b"\x7fELF"
    for entry in entries:
        assert entry.encode() in cubin


@pytest.mark.parametrize("algorithm,arch,atom", [
    ("direct-push", "sm_80", "ldst"), (PACKED, "sm_90", "ldst"), ("two-shot", "sm_90", "tma"), ("ring", "sm_100", "ldst"),
])
def test_int64_reductions_compile(cache_dir, algorithm, arch, atom):
    # 8-byte elements: two per 16-byte vector, one per LL packet's data word; sums wrap in 64 bits
    case, error, entries, cubin = _compile_case(("allreduce", 2, algorithm, arch, atom, "int64", "sum"))
    assert error is None, error
    assert cubin[:4] == b"\x7fELF" and all(entry.encode() in cubin for entry in entries)


@pytest.mark.parametrize("example,overrides", [
    ("fused/allreduce_add_rmsnorm.pln", {"algorithm": "two-shot"}),
    ("fused/allreduce_add_rmsnorm_fp8.pln", {"packed": True}),
    ("sized/alltoallv.pln", {}),
])
def test_fused_and_sized_modules_compile_without_warnings(tmp_path, monkeypatch, example, overrides):
    """The matrix above covers the plain examples; these are the other templates' modules."""
    monkeypatch.setenv("PURLIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PURLIN_NO_CACHE", "1")
    with _NvrtcLog() as warnings:
        artifact = pipeline.compile(EXAMPLES / example, world_size=2, arch="sm_90", overrides=overrides)
        assert artifact.cubin[:4] == b"\x7fELF"
    assert warnings.lines == []


@pytest.mark.parametrize("root", [0, 1])
def test_a_program_that_only_signals_compiles_without_warnings(tmp_path, monkeypatch, root):
    """The matrix compiles no registered schedules: a broadcast into registered outputs
    leaves the receiver only a notify and a wait, and its body's unused slice0 warned."""
    monkeypatch.setenv("PURLIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PURLIN_NO_CACHE", "1")
    with _NvrtcLog() as warnings:
        artifact = pipeline.compile(EXAMPLES / "broadcast.pln", world_size=2, params={"root": root}, arch="sm_90",
                                    overrides={"registered": frozenset({"out"})})
        assert artifact.cubin[:4] == b"\x7fELF"
    assert warnings.lines == []


def test_reading_an_empty_log_writes_no_shared_object(tmp_path, monkeypatch):
    """An empty NVRTC log is one NUL byte; read into b" " * 1 (the interpreter's shared
    one-byte object), it turned every b" " in the process into b"\\x00" (an environment
    variable set to " " then failed with "embedded null byte")."""
    monkeypatch.setenv("PURLIN_NO_CACHE", "1")
    with _NvrtcLog():  # at DEBUG a successful compile reads its log
        nvrtc.compile_cubin(TINY % 7, "tiny.cu", "sm_90")
    assert ord(" ".encode()) == 32 and ord(bytes([32])) == 32


def test_an_nvrtc_that_cannot_be_loaded_is_a_user_error(monkeypatch):
    """cuda.bindings loads the library at its first call: a missing or mismatched one (cuda-
    bindings 12.8 asks for libnvrtc.so.12) came out as 'internal error (a bug in purlinc)'."""
    from cuda.bindings import nvrtc as bindings

    from purlinc.errors import PurlinError

    def missing():
        raise RuntimeError("Failed to dlopen libnvrtc.so.12")

    monkeypatch.setattr(nvrtc, "_LOADED", False)
    monkeypatch.setattr(bindings, "nvrtcVersion", missing)
    with pytest.raises(PurlinError, match=r"cannot load NVRTC: RuntimeError: Failed to dlopen libnvrtc.so.12") as info:
        nvrtc._nvrtc()
    assert "pip install cuda-bindings nvidia-cuda-nvrtc" in info.value.notes[0]


# ---- the cache -------------------------------------------------------------------------

TINY = 'extern "C" __global__ void purlin_tiny(int* p) { p[threadIdx.x] = %d; }\n'


def test_cache_hit_does_no_nvrtc_work(tmp_path, monkeypatch):
    monkeypatch.setenv("PURLIN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PURLIN_NO_CACHE", raising=False)
    source = TINY % 101
    before = nvrtc.STATS.compiles
    first = nvrtc.compile_cubin(source, "tiny.cu", "sm_90")
    assert nvrtc.STATS.compiles == before + 1
    assert len(list(tmp_path.rglob("*.cubin"))) == 1
    hits = nvrtc.STATS.cache_hits
    second = nvrtc.compile_cubin(source, "tiny.cu", "sm_90")
    assert nvrtc.STATS.compiles == before + 1 and nvrtc.STATS.cache_hits == hits + 1
    assert first == second
    # another target, another option or another source: another entry
    nvrtc.compile_cubin(source, "tiny.cu", "sm_80")
    nvrtc.compile_cubin(source, "tiny.cu", "sm_90", ("-DPURLIN_TEST=1",))
    nvrtc.compile_cubin(TINY % 102, "tiny.cu", "sm_90")
    assert nvrtc.STATS.compiles == before + 4
    assert len(list(tmp_path.rglob("*.cubin"))) == 4
    assert not list(tmp_path.rglob(".tmp-*"))


def test_no_cache_bypasses(tmp_path, monkeypatch):
    monkeypatch.setenv("PURLIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PURLIN_NO_CACHE", "1")
    before = nvrtc.STATS.compiles
    nvrtc.compile_cubin(TINY % 103, "tiny.cu", "sm_90")
    nvrtc.compile_cubin(TINY % 103, "tiny.cu", "sm_90")
    assert nvrtc.STATS.compiles == before + 2
    assert not list(tmp_path.rglob("*"))


def test_cache_dir_relocates(tmp_path, monkeypatch):
    monkeypatch.delenv("PURLIN_NO_CACHE", raising=False)
    for sub in ("a", "b"):
        monkeypatch.setenv("PURLIN_CACHE_DIR", str(tmp_path / sub))
        before = nvrtc.STATS.compiles
        nvrtc.compile_cubin(TINY % 104, "tiny.cu", "sm_90")
        assert nvrtc.STATS.compiles == before + 1  # a new place: nothing cached there yet
        assert len(list((tmp_path / sub).rglob("*.cubin"))) == 1


def test_corrupt_cache_dir_is_not_fatal(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("PURLIN_CACHE_DIR", str(blocker))
    monkeypatch.delenv("PURLIN_NO_CACHE", raising=False)
    assert nvrtc.compile_cubin(TINY % 105, "tiny.cu", "sm_90")[:4] == b"\x7fELF"


# ---- errors ----------------------------------------------------------------------------

def test_compile_error_is_readable(tmp_path, monkeypatch):
    monkeypatch.setenv("PURLIN_NO_CACHE", "1")
    source = 'extern "C" __global__ void broken() { undeclared_thing = 1; }\n'
    with pytest.raises(PurlinError) as error:
        nvrtc.compile_cubin(source, "purlin_broken.cu", "sm_90")
    text = error.value.render()
    assert text.startswith("error: NVRTC compilation of purlin_broken.cu (--gpu-architecture=sm_90 ")
    assert "failed: NVRTC_ERROR_COMPILATION" in text
    assert "undeclared_thing" in text and "NVRTC log:" in text
    kept = next(n for n in error.value.notes if n.startswith("generated source kept at "))
    path = Path(kept.removeprefix("generated source kept at "))
    assert path.name.startswith("purlin_broken-") and path.read_text() == source
    path.unlink()


def test_bad_option_is_readable(monkeypatch):
    monkeypatch.setenv("PURLIN_NO_CACHE", "1")
    with pytest.raises(PurlinError) as error:
        nvrtc.compile_cubin(TINY % 106, "tiny.cu", "sm_90", ("--no-such-option",))
    text = error.value.render()
    assert "NVRTC_ERROR_INVALID_OPTION" in text and "--no-such-option" in text


def test_bad_arch_is_readable():
    with pytest.raises(PurlinError, match="unknown target architecture 'sm_12'"):
        nvrtc.compile_cubin(TINY % 107, "tiny.cu", "sm_12")


def test_versions():
    major, minor = nvrtc.nvrtc_version().split(".")
    assert int(major) >= 12 and int(minor) >= 0
    assert nvrtc.normalize_options("sm_90", (" -lineinfo", "-DX=1", "-DX=1")) == (
        "--gpu-architecture=sm_90", *nvrtc.BASE_OPTIONS, "-DX=1",
    )


# ---- the SASS --------------------------------------------------------------------------

def _tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for candidate in sorted(Path(root).glob(f"*/bin/{name}")):
            if os.access(candidate, os.X_OK):
                return str(candidate)
    return None


def _sass(cubin: bytes, tmp_path: Path) -> str:
    cuobjdump, nvdisasm = _tool("cuobjdump"), _tool("nvdisasm")
    if cuobjdump is None or nvdisasm is None:
        pytest.skip("no disassembler: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm (the 'test' extra)")
    path = tmp_path / "module.cubin"
    path.write_bytes(cubin)
    env = dict(os.environ, PATH=f"{Path(nvdisasm).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    done = subprocess.run([cuobjdump, "-sass", str(path)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _cubin(name: str, atom: str, arch: str, world_size: int = 2) -> bytes:
    spec = _spec(name, world_size)
    schedule = pipeline.snac_stage(spec, pipeline.default_options(spec))
    op = ReduceOp.SUM if spec.is_reduce else None
    kernel = generate(schedule, spec, atom=atom, arch=arch, dtype=DType.BFLOAT16, op=op)
    return nvrtc.compile_cubin(kernel.source, kernel.filename, arch)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_ldst_uses_128_bit_accesses(arch, tmp_path, cache_dir):
    sass = _sass(_cubin("allreduce", "ldst", arch), tmp_path)
    assert "LDG.E.128" in sass and "STG.E.128" in sass
    assert "UBLKCP" not in sass


def test_tma_issues_bulk_copies(tmp_path, cache_dir):
    sass = _sass(_cubin("allgather", "tma", "sm_90"), tmp_path)
    assert "UBLKCP" in sass  # cp.async.bulk (global <-> shared)
    assert "SYNCS" in sass  # the mbarrier the loads complete on
