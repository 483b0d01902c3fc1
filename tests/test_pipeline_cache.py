"""The front compile cache (purlinc/pipeline/ + purlinc/atom/cache.py): a second compile of
the same inputs, in this process or a fresh one, does no lowering, verification, code
generation or NVRTC work; any changed input misses; a damaged entry is a miss that gets
rewritten; PURLIN_NO_CACHE and PURLIN_CACHE_DIR are honoured.  Asserted with counters,
monkeypatched stages and sys.modules, never with times.

Each Compiled has one schedule entry on disk, and each of its (dtype, op) kernels one kernel
entry; in one process, the same inputs give the same Compiled (``pipeline.forget`` drops it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from purlinc import pipeline
from purlinc.atom import cache, nvrtc
from purlinc.errors import PurlinError
from purlinc.pipeline import stages

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ALLGATHER = EXAMPLES / "allgather.pln"


# cache_dir: conftest's (an empty cache, and no in-process memo either side of each test, so
# what one test compiled is not what another reads back).


def _work() -> tuple[int, ...]:
    s = pipeline.STATS
    return (s.lowerings, s.verifications, s.generations, nvrtc.STATS.compiles, nvrtc.STATS.cache_hits)


def _forbid_work(monkeypatch) -> None:
    """Any stage past the front cache now fails the test."""
    def boom(*args, **kwargs):
        raise AssertionError("a front-cache hit ran a compiler stage")

    import purlinc.atom.codegen as codegen

    # Where the pipeline looks its stages up (Compiled lowers through ``stages.snac_stage``);
    # the package's names are re-exports, which the pipeline itself never calls.
    monkeypatch.setattr(stages, "snac_stage", boom)
    monkeypatch.setattr(stages, "parse_stage", boom)
    monkeypatch.setattr(codegen, "generate", boom)
    monkeypatch.setattr(nvrtc, "compile_cubin", boom)
    monkeypatch.setattr(nvrtc, "_compile", boom)


def _entries(path: Path) -> list[Path]:
    return sorted((path / "front").rglob("*.entry")) if (path / "front").exists() else []


def test_second_compile_in_process_hits(cache_dir, monkeypatch):
    first = pipeline.compile(ALLGATHER, world_size=2, arch="sm_90")
    assert not first.from_cache and len(_entries(cache_dir)) == 2  # the schedule and the kernel
    hits, memo = pipeline.STATS.front_hits, pipeline.STATS.memo_hits
    work = _work()
    with monkeypatch.context() as patch:
        _forbid_work(patch)
        second = pipeline.compile(ALLGATHER, world_size=2, arch="sm_90")
        assert second.from_cache and pipeline.STATS.front_hits == hits + 1 and pipeline.STATS.memo_hits == memo + 1
        assert second.compiled is first.compiled
        assert second.cubin == first.cubin and second.cubin[:4] == b"\x7fELF"
        for name in ("source", "filename", "kernel_base", "abi", "atom", "arch", "dtype", "op", "atom_source",
                     "orchestration_source"):
            assert getattr(second.cuda, name) == getattr(first.cuda, name), name
        assert second.schedule == first.schedule
        assert (second.collective, second.params, second.arch, second.atom, second.dtype, second.op) == (
            first.collective, first.params, first.arch, first.atom, first.dtype, first.op)
    assert _work() == work
    assert second.spec == first.spec


def test_fresh_compiled_reads_both_entries(cache_dir, monkeypatch):
    """With the process's memos dropped, the schedule and the kernel come from disk."""
    first = pipeline.compile(ALLGATHER, world_size=2, arch="sm_90")
    pipeline.forget()
    work = _work()
    with monkeypatch.context() as patch:
        _forbid_work(patch)
        hits = pipeline.STATS.schedule_hits
        again = pipeline.compile(ALLGATHER, world_size=2, arch="sm_90")
        assert again.from_cache and again.compiled is not first.compiled
        assert again.schedule == first.schedule and pipeline.STATS.schedule_hits == hits + 1
        assert again.cubin == first.cubin and again.cuda.source == first.cuda.source
    assert _work() == work


def test_traced_kernel_from_disk_keeps_its_blocks(cache_dir):
    """A traced kernel read back from the cache still says which steps each stamp covers
    (coll.trace() reads them)."""
    first = pipeline.prepare(ALLGATHER, world_size=2, arch="sm_90", trace=True)
    made = first.kernel("bfloat16", "sum", emit_cubin=False).cuda.trace_blocks
    assert made and all(any(block for block in channel) for rank in made for channel in rank)
    pipeline.forget()
    again = pipeline.prepare(ALLGATHER, world_size=2, arch="sm_90", trace=True).kernel("bfloat16", "sum",
                                                                                    emit_cubin=False)
    assert again.from_cache and again.cuda.trace_blocks == made


def test_fresh_process_hits_and_imports_little(cache_dir):
    pipeline.compile(ALLGATHER, world_size=2, arch="sm_90")
    child = f"""
import json, sys
from purlinc import pipeline
from purlinc.atom import nvrtc
artifact = pipeline.compile({str(ALLGATHER)!r}, world_size=2, arch="sm_90")
heavy = ("lark", "jinja2", "numpy", "cuda.bindings", "purlinc.frontend.parse", "purlinc.frontend.lalr",
         "purlinc.frontend.syntax_errors", "purlinc.snac.lower",
         "purlinc.snac.verify", "purlinc.atom.codegen")
print(json.dumps({{"stats": [pipeline.STATS.front_hits, pipeline.STATS.front_misses, pipeline.STATS.lowerings,
                   pipeline.STATS.verifications, pipeline.STATS.generations, nvrtc.STATS.compiles,
                   nvrtc.STATS.cache_hits, pipeline.STATS.parses, pipeline.STATS.checks],
                  "imported": [m for m in heavy if m in sys.modules],
                  "elf": artifact.cubin[:4] == b"\\x7fELF"}}))
"""
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=dict(os.environ),
                          timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["stats"] == [1, 0, 0, 0, 0, 0, 0, 0, 0]
    assert result["imported"] == []
    assert result["elf"]


def _variant(change: str) -> dict:
    base = dict(path_or_source=ALLGATHER, world_size=2, arch="sm_90", atom="ldst", dtype="bfloat16", op="sum",
                params=None, emit_cubin=False)
    if change == "source":
        base["path_or_source"] = ALLGATHER.read_text() + "\n// a comment changes the key\n"
    elif change == "world_size":
        base["world_size"] = 4
    elif change == "params":
        base["path_or_source"] = EXAMPLES / "broadcast.pln"
    elif change == "params2":
        base["path_or_source"], base["params"] = EXAMPLES / "broadcast.pln", {"root": 1}
    elif change == "options":
        base["overrides"] = {"channels": 2}
    elif change == "options_object":
        base["options"] = pipeline.default_options(pipeline.spec_stage(
            pipeline.parse_stage(pipeline.load_source(ALLGATHER)), 2, None)).__class__(channels=2)
    elif change == "algorithm":
        base["algorithm"] = "direct-pull"
    elif change == "atom":
        base["atom"] = "tma"
    elif change == "arch":
        base["arch"] = "sm_80"
    elif change == "dtype":
        base["dtype"] = "float32"
    elif change == "reduce":
        base["path_or_source"] = EXAMPLES / "allreduce.pln"
    elif change == "op":
        base["path_or_source"], base["op"] = EXAMPLES / "allreduce.pln", "max"
    return base


CHANGES = ("source", "world_size", "params", "params2", "options", "options_object", "algorithm", "atom", "arch",
           "dtype", "reduce", "op")
# Changes that keep the schedule: a new kernel of the same Compiled ("op" is allreduce like "reduce").
KERNEL_ONLY = ("dtype", "op")


def test_every_input_changes_the_key(cache_dir):
    """Each variant misses once (a new kernel entry, and a new schedule entry unless only the
    dtype or op changed), then hits; no two variants share an entry."""
    for change in ("base", *CHANGES):
        kwargs = _variant(change)
        path = kwargs.pop("path_or_source")
        misses, lowerings = pipeline.STATS.front_misses, pipeline.STATS.lowerings
        first = pipeline.compile(path, **kwargs)
        assert pipeline.STATS.front_misses == misses + 1, f"{change}: hit an entry of other inputs"
        assert pipeline.STATS.lowerings == lowerings + (0 if change in KERNEL_ONLY else 1), change
        assert not first.from_cache and first.cubin is None
        again = pipeline.compile(path, **kwargs)
        assert again.from_cache, change
        assert again.cuda.source == first.cuda.source and again.schedule == first.schedule
    kernels = 1 + len(CHANGES)
    schedules = 1 + len(CHANGES) - len(KERNEL_ONLY)
    assert len(_entries(cache_dir)) == kernels + schedules


def test_new_option_fields_enter_the_key():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Options:
        channels: int = 1
        packed: bool = False

        def key(self) -> str:  # an old key() that forgot the new field
            return f"c{self.channels}"

    source = pipeline.SourceText("collective x {}", "<string>")
    common = dict(world_size=2, params=None, arch="sm_90", overrides=None, algorithm=None, atom="ldst",
                  dtype="bfloat16", op="sum", emit_cubin=False)
    a = pipeline._front_inputs(source, options=Options(), **common)
    b = pipeline._front_inputs(source, options=Options(packed=True), **common)
    assert cache.front_key(a) != cache.front_key(b)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "flipped", "empty", "bad_header"])
def test_damaged_entry_is_a_miss_and_is_rewritten(cache_dir, damage):
    first = pipeline.compile(ALLGATHER, world_size=2, arch="sm_90", emit_cubin=False)
    for entry in _entries(cache_dir):  # the schedule's and the kernel's
        _damage(entry, damage)
    pipeline.forget()
    misses, lowerings = pipeline.STATS.front_misses, pipeline.STATS.lowerings
    again = pipeline.compile(ALLGATHER, world_size=2, arch="sm_90", emit_cubin=False)
    assert pipeline.STATS.front_misses == misses + 1 and not again.from_cache
    assert pipeline.STATS.lowerings == lowerings + 1
    assert again.cuda.source == first.cuda.source
    for entry in _entries(cache_dir):
        assert entry.read_bytes() != damaged[entry]  # rewritten
    pipeline.forget()
    assert pipeline.compile(ALLGATHER, world_size=2, arch="sm_90", emit_cubin=False).from_cache


damaged: dict = {}


def _damage(entry: Path, damage: str) -> None:
    data = entry.read_bytes()
    if damage == "garbage":
        data = b"not an entry at all" * 10
    elif damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "flipped":
        middle = len(data) // 2
        data = data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:]
    elif damage == "empty":
        data = b""
    elif damage == "bad_header":  # a sound checksum over a header of the wrong shape
        import hashlib

        body = cache._FRONT_MAGIC + cache._LENGTH.pack(2) + b"{}"
        data = body + hashlib.sha256(body).digest()
    entry.write_bytes(data)
    damaged[entry] = data


@pytest.mark.parametrize("damage", ["truncated", "flipped", "empty", "garbage"])
def test_a_damaged_cubin_is_a_miss_not_an_artifact(cache_dir, damage):
    """The NVRTC level's CUBIN carries a checksum: a damaged one was handed back as the
    artifact (and sealed into a new front entry) when the front entry was gone."""
    first = pipeline.compile(ALLGATHER, world_size=2, arch="sm_90")
    (cubin,) = cache_dir.glob("*/*.cubin")
    _damage(cubin, damage)
    for entry in _entries(cache_dir):
        entry.unlink()
    pipeline.forget()
    compiles = nvrtc.STATS.compiles
    again = pipeline.compile(ALLGATHER, world_size=2, arch="sm_90")
    assert nvrtc.STATS.compiles == compiles + 1 and again.cubin == first.cubin
    assert cubin.read_bytes() != damaged[cubin]  # rewritten
    pipeline.forget()
    assert pipeline.compile(ALLGATHER, world_size=2, arch="sm_90").cubin == first.cubin


def test_something_other_than_a_file_at_an_entry_is_a_miss(cache_dir):
    """A named pipe at an entry's path made the compile wait forever on its read."""
    pipeline.compile(ALLGATHER, world_size=2, arch="sm_90")
    paths = [*_entries(cache_dir), *cache_dir.glob("*/*.cubin")]
    for path in paths:
        path.unlink()
        os.mkfifo(path)
    pipeline.forget()
    assert not pipeline.compile(ALLGATHER, world_size=2, arch="sm_90").from_cache
    assert cache.load("0" * 64) is None and cache.load_front("0" * 64) is None


def test_no_cache_bypasses_both_levels(cache_dir, monkeypatch):
    monkeypatch.setenv("PURLIN_NO_CACHE", "1")
    work = _work()
    for _ in range(2):
        artifact = pipeline.compile(ALLGATHER, world_size=2, arch="sm_90")
        assert not artifact.from_cache
    lowerings, _, generations, compiles, cache_hits = _work()
    assert (lowerings, generations, compiles, cache_hits) == (work[0] + 2, work[2] + 2, work[3] + 2, work[4])
    assert not cache_dir.exists()


def test_cache_dir_relocates_both_levels(tmp_path, monkeypatch):
    monkeypatch.delenv("PURLIN_NO_CACHE", raising=False)
    for sub in ("a", "b"):
        monkeypatch.setenv("PURLIN_CACHE_DIR", str(tmp_path / sub))
        artifact = pipeline.compile(ALLGATHER, world_size=2, arch="sm_80", atom="ldst", dtype="float16")
        assert not artifact.from_cache  # a new place: nothing cached there yet
        assert len(_entries(tmp_path / sub)) == 2  # the schedule and the kernel
        assert len(list((tmp_path / sub).glob("*/*.cubin"))) == 1
        assert pipeline.compile(ALLGATHER, world_size=2, arch="sm_80", atom="ldst", dtype="float16").from_cache


def test_unwritable_cache_is_not_fatal(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("PURLIN_CACHE_DIR", str(blocker))
    monkeypatch.delenv("PURLIN_NO_CACHE", raising=False)
    artifact = pipeline.compile(ALLGATHER, world_size=2, arch="sm_90", emit_cubin=False)
    assert not artifact.from_cache and artifact.cuda.source


def test_nvrtc_fingerprint_needs_no_nvrtc():
    """Read from distribution folders; stable within the process."""
    assert nvrtc.nvrtc_fingerprint() == nvrtc.nvrtc_fingerprint()
    assert "cuda_bindings=" in nvrtc.nvrtc_fingerprint() or "nvrtc=" in nvrtc.nvrtc_fingerprint()


def test_a_kernel_error_keeps_its_location_when_the_schedule_comes_from_the_cache(cache_dir):
    """The cached schedule's epilogue has no source spans: the row check that depends on the
    dtype (and on R, for rows(R)) must still point at rows(...) and say which R."""
    source = ("collective e {\n    in[r] = x\n    out[r] = x\n    reduce\n"
              "    epilogue rows(R + 2) {\n        out = out * 2.0\n    }\n}\n")
    rendered = []
    for _ in range(2):  # the second compile reads the schedule back from the cache
        pipeline.forget()
        with pytest.raises(PurlinError) as info:
            pipeline.prepare(source, world_size=2).kernel("bfloat16", "sum")
        rendered.append(info.value.render())
    assert pipeline.STATS.schedule_hits >= 1
    assert rendered[0] == rendered[1]
    assert rendered[1].startswith("<string>:5:19: error: a row of 4 bfloat16 elements is 8 bytes")
    assert rendered[1].endswith("note: while generating e's bfloat16 kernels for R=2")


def test_a_cubin_stored_under_another_key_is_a_miss(cache_dir):
    """A CUBIN entry held only its checksum: one copied (or linked) under another key was
    launched as the artifact, and sealed into a new front entry."""
    ours = pipeline.compile(ALLGATHER, world_size=2, arch="sm_90")
    (mine,) = cache_dir.glob("*/*.cubin")
    other = pipeline.compile(EXAMPLES / "alltoall.pln", world_size=2, arch="sm_90")
    (theirs,) = set(cache_dir.glob("*/*.cubin")) - {mine}
    assert other.cubin != ours.cubin
    mine.write_bytes(theirs.read_bytes())
    for entry in _entries(cache_dir):
        entry.unlink()
    pipeline.forget()
    assert pipeline.compile(ALLGATHER, world_size=2, arch="sm_90").cubin == ours.cubin


def test_a_killed_writers_temporary_file_is_removed_later(cache_dir):
    """Nothing removed the .tmp-* file of a compiler killed between its write and its rename."""
    from purlinc import cachefiles

    pipeline.compile(ALLGATHER, world_size=2, arch="sm_90")
    (cubin,) = cache_dir.glob("*/*.cubin")
    stale, fresh = cubin.parent / ".tmp-stale_01.cubin", cubin.parent / ".tmp-fresh_01.cubin"  # mkstemp's shape
    for path in (stale, fresh):
        path.write_bytes(b"half an entry")
    old = os.stat(stale).st_mtime - cachefiles.STALE_TEMP_S - 60
    os.utime(stale, (old, old))
    cubin.unlink()
    for entry in _entries(cache_dir):
        entry.unlink()
    pipeline.forget()
    pipeline.compile(ALLGATHER, world_size=2, arch="sm_90")  # rewrites the CUBIN into that folder
    assert not stale.exists() and fresh.exists()  # a writer of now may still rename its own


def test_one_temporary_file_that_cannot_be_removed_does_not_keep_the_others(tmp_path, monkeypatch):
    from purlinc import cachefiles

    old = os.stat(tmp_path).st_mtime - cachefiles.STALE_TEMP_S - 60
    for name in (".tmp-aaaaaaaa.entry", ".tmp-bbbbbbbb.entry", ".tmp-cccccccc.entry"):
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (old, old))
    unlink = os.unlink

    def refuse_one(path, *args, **kwargs):
        if str(path).endswith(".tmp-bbbbbbbb.entry"):
            raise PermissionError(13, "Permission denied", str(path))
        unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refuse_one)
    cachefiles.write_atomically(tmp_path / "key.entry", (b"data",))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-bbbbbbbb.entry", "key.entry"]


def test_the_sweep_of_temporary_files_leaves_the_users_own_files(tmp_path):
    """PURLIN_CACHE_DIR may name a folder of the user's: an old file of theirs that starts .tmp-
    is not a killed writer's (those are mkstemp's .tmp-XXXXXXXX plus the entry's suffix)."""
    from purlinc import cachefiles

    old = os.stat(tmp_path).st_mtime - cachefiles.STALE_TEMP_S - 60
    names = (".tmp-notes.txt", ".tmp-abcdefgh.txt", ".tmp-abcdefghi.entry", ".tmp-abc.entry", ".tmp-abcdefgh.entry")
    for name in names:
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (old, old))
    cachefiles.write_atomically(tmp_path / "key.entry", (b"data",))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({*names, "key.entry"} - {".tmp-abcdefgh.entry"})


def test_cache_files_check_their_start_before_reading_the_rest(tmp_path):
    from purlinc import cachefiles

    path = tmp_path / "entry"
    path.write_bytes(bytes(1 << 20))  # a file of zeros (a truncate -s): refused on its first bytes
    assert cachefiles.read_regular(path, starts=b"MAGIC") is None
    path.write_bytes(b"MAGIC and the rest")
    assert cachefiles.read_regular(path, starts=b"MAGIC") == b"MAGIC and the rest"
    assert cachefiles.read_regular(path, most=5, starts=b"MAGIC") is None
    assert cachefiles.read_regular(path, most=2, starts=b"MAGIC") is None  # was a ValueError from read(-2)


def test_a_directory_at_an_entry_path_is_named_in_the_error(tmp_path):
    """The log named the writer's temporary file, not the entry that was in the way."""
    from purlinc import cachefiles

    entry = tmp_path / "ab" / "key.entry"
    (entry / "inside").mkdir(parents=True)
    with pytest.raises(OSError) as caught:
        cachefiles.write_atomically(entry, (b"data",))
    assert caught.value.filename == str(entry)
    assert [p.name for p in entry.parent.iterdir()] == ["key.entry"]  # no temporary file left


def test_from_cache_is_this_calls_own_answer(cache_dir, monkeypatch):
    """from_cache compared the process-wide hit counter before and after: another thread's hit
    during a fresh compile made it say True."""
    real = cache.load_front

    def another_threads_hit(key):
        pipeline.STATS.front_hits += 1
        return real(key)

    monkeypatch.setattr(cache, "load_front", another_threads_hit)
    assert not pipeline.compile(ALLGATHER, world_size=2, arch="sm_90", emit_cubin=False).from_cache
    assert pipeline.compile(ALLGATHER, world_size=2, arch="sm_90", emit_cubin=False).from_cache


def test_with_no_place_for_the_cache_the_process_memo_still_serves(monkeypatch, caplog):
    """No home directory: the disk cache has no place, but this process's memo of Compiled
    objects still serves (every load had redone the front end and NVRTC), and it is said once."""
    import logging
    import pwd

    from purlinc.pipeline import compiled

    for name in ("PURLIN_CACHE_DIR", "PURLIN_NO_CACHE", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: (_ for _ in ()).throw(KeyError(uid)))
    monkeypatch.setattr(compiled, "_UNPLACED_SAID", False)
    monkeypatch.setattr(logging.getLogger("purlin"), "propagate", True)
    pipeline.forget()
    with caplog.at_level(logging.WARNING, logger="purlin.cache"):
        first = pipeline.prepare(ALLGATHER, world_size=2)
        assert pipeline.prepare(ALLGATHER, world_size=2) is first and not first.cached
    said = [r.getMessage() for r in caplog.records if r.name == "purlin.cache"]
    assert len(said) == 1 and said[0].startswith("the compile cache is not used: no home directory is known")


def test_threads_asking_for_one_spec_at_once_parse_and_check_it_once(monkeypatch):
    """Each thread looked the memo up, found nothing and made its own: on a cold start 8 threads
    parsed one file up to 8 times.  The first asker makes it; the others wait for its value
    (or its error), and threads asking for other keys are not held up."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    pipeline.forget()
    parse, calls = stages.parse_stage, []

    def slow_parse(source):
        calls.append(threading.get_ident())
        time.sleep(0.05)  # every thread arrives while the first still parses
        return parse(source)

    monkeypatch.setattr(stages, "parse_stage", slow_parse)
    source = pipeline.load_source(ALLGATHER)
    before = stages.STATS.checks
    with ThreadPoolExecutor(8) as pool:
        specs = list(pool.map(lambda i: stages.spec_of(source, 2 + i % 4, None), range(16)))
    assert len(calls) == 1 and stages.STATS.checks - before == 4  # one parse; one check per world size
    assert all(spec is stages.spec_of(source, spec.world_size, None) for spec in specs)
    bad = pipeline.load_source("collective broken { in[r] = x[r] }")
    with ThreadPoolExecutor(4) as pool:
        errors = [f.exception() for f in [pool.submit(stages.definition_of, bad) for _ in range(4)]]
    assert all(isinstance(error, PurlinError) for error in errors) and len(calls) == 2  # the error, made once
    pipeline.forget()
