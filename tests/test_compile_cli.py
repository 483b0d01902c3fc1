"""``purlinc compile``: the files it writes, the manifest, and its errors (exit status 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from purlinc.atom.abi import KernelABI
from purlinc.cli import main

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PURLIN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cli-cache"))
    monkeypatch.delenv("PURLIN_NO_CACHE", raising=False)


def _compile(capsys, *args):
    status = main(["compile", *map(str, args)])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_compile_allgather_default_ranks(tmp_path, capsys):
    status, out, err = _compile(capsys, EXAMPLES / "allgather.pln", "--arch", "sm_90", "-o", tmp_path)
    assert status == 0, err
    written = [Path(line) for line in out.splitlines()]
    names = sorted(p.name for p in written)
    stem = written[0].name.removesuffix(".cu")
    base = stem.removesuffix(".sm_90")  # files are <kernel_base>.<arch>.*; entries <kernel_base>_b<body>
    assert base.startswith("purlin_allgather_") and stem == f"{base}.sm_90"
    assert names == sorted(f"{stem}{ext}" for ext in (".cu", ".cubin", ".schedule.json", ".manifest.json"))
    assert all(p.exists() and p.parent == tmp_path for p in written)
    assert (tmp_path / f"{stem}.cubin").read_bytes()[:4] == b"\x7fELF"

    manifest = json.loads((tmp_path / f"{stem}.manifest.json").read_text())
    assert manifest["collective"] == "allgather"
    assert manifest["ranks"] == 8 and manifest["ranks_defaulted"] is True
    assert (manifest["arch"], manifest["atom"], manifest["dtype"], manifest["op"]) == ("sm_90", "ldst", "bfloat16", None)
    assert manifest["algorithm"] == "direct-push" and manifest["options_key"].startswith("direct-push/")
    assert manifest["entries"] == [f"{base}_b0"] * 8  # every rank runs the one body
    assert manifest["launch"]["grid"] == [1, 1, 1] and manifest["launch"]["block"][0] > 0
    assert manifest["abi"]["args_bytes"] == KernelABI(
        base, 8, 1, 1, 0, 2, 0, 1, 1, 0, (), (), False, False,
    ).args_bytes
    assert (manifest["abi"]["slices"], manifest["abi"]["stage_copies"]) == (1, 2)
    assert manifest["buffers"]["out_units"] == [8] * 8 and manifest["buffers"]["in_units"] == [1] * 8
    # stage_units is per staging copy: the ABI's is both copies together
    buffers, abi = manifest["buffers"], manifest["abi"]
    assert buffers["stage_units"] * buffers["stage_copies"] == abi["stage_units"]
    assert set(manifest["versions"]) == {"purlinc", "nvrtc", "cuda-bindings"}
    assert all(manifest["versions"].values())

    assert manifest["files"] == {"cuda": f"{stem}.cu", "cubin": f"{stem}.cubin", "schedule": f"{stem}.schedule.json"}
    schedule = json.loads((tmp_path / f"{stem}.schedule.json").read_text())
    assert schedule["collective"] == "allgather" and schedule["world_size"] == 8


def test_compile_reduction_with_options(tmp_path, capsys):
    status, out, err = _compile(
        capsys, EXAMPLES / "allreduce.pln", "--ranks", "4", "--arch", "sm_100", "--atom", "tma",
        "--dtype", "float32", "--op", "max", "--algorithm", "two-shot", "--channels", "2", "--slices", "2",
        "-o", tmp_path,
    )
    assert status == 0, err
    manifest = json.loads(next(tmp_path.glob("*.manifest.json")).read_text())
    assert manifest["ranks"] == 4 and manifest["ranks_defaulted"] is False
    assert (manifest["atom"], manifest["dtype"], manifest["op"], manifest["algorithm"]) == ("tma", "float32", "max", "two-shot")
    assert manifest["launch"]["grid"] == [2, 1, 1]


def test_compile_params(tmp_path, capsys):
    status, _, err = _compile(capsys, EXAMPLES / "broadcast.pln", "-R", "2", "--param", "root=1", "-o", tmp_path)
    assert status == 0, err
    manifest = json.loads(next(tmp_path.glob("*.manifest.json")).read_text())
    assert manifest["params"] == {"root": 1}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--atom", "tma", "--arch", "sm_80"], "error: --atom tma needs sm_90 or newer, not --arch sm_80\n"
                                               "note: atoms for sm_80: ldst"),
        (["--arch", "sm_9"], "error: --arch: unknown target architecture 'sm_9'"),
        # refused with the spec, before the generator (whose note "while generating" came twice)
        (["--dtype", "float8_e4m3"], "error: --dtype float8_e4m3: float8_e4m3 cannot be reduced, and the "
                                     "collective allreduce is a reduction\n"
                                     "note: a reduction takes float32, float16, bfloat16, int32, int64; fp8 is "
                                     "supported for copies only\n"),
        (["--dtype", "float64"], "error: unknown dtype 'float64'"),
    ],
)
def test_compile_errors(tmp_path, capsys, args, message):
    status, out, err = _compile(capsys, EXAMPLES / "allreduce.pln", "-R", "2", *args, "-o", tmp_path)
    assert status == 2
    assert err.startswith(message), err
    assert "Traceback" not in err and out == ""
    assert not list(tmp_path.iterdir())


def test_artifacts_are_written_all_or_none(tmp_path, capsys):
    """A directory where the schedule goes: refused before any artifact is replaced, naming that
    path (not a temporary file), and no temporary file left.  Before, the .cu and .cubin of the
    new compile sat beside the old manifest."""
    status, out, err = _compile(capsys, EXAMPLES / "allreduce.pln", "-o", tmp_path)
    assert status == 0, err
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    (schedule,) = tmp_path.glob("*.schedule.json")
    schedule.unlink()
    schedule.mkdir()
    # the same names again, with a manifest that differs (--ranks given this time)
    status, out, err = _compile(capsys, EXAMPLES / "allreduce.pln", "-R", "8", "-o", tmp_path)
    assert status == 2 and out == ""
    assert err.startswith(f"error: cannot write the artifacts into {tmp_path}: {schedule}: not a file"), err
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert after == {name: data for name, data in before.items() if name != schedule.name}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_an_interrupt_between_renames_leaves_no_temporary_file(tmp_path, capsys, monkeypatch):
    """Ctrl-C at the second rename: the other artifacts' temporary files stayed in -o for ever
    (only an OSError removed them)."""
    import os

    replace, calls = os.replace, []

    def interrupted(src, dst):
        if Path(dst).parent == tmp_path:  # the artifacts' renames, not the caches'
            calls.append(dst)
            if len(calls) == 2:
                raise KeyboardInterrupt
        replace(src, dst)

    monkeypatch.setattr(os, "replace", interrupted)
    status, _, _ = _compile(capsys, EXAMPLES / "allreduce.pln", "-R", "2", "-o", tmp_path)
    assert status == 130  # 128 + SIGINT, as a shell reports it
    assert [p.name for p in tmp_path.iterdir()] == [Path(calls[0]).name]


def test_a_killed_compiles_temporary_files_are_removed_by_a_later_one(tmp_path, capsys):
    """A compile killed between its writes and its renames leaves .<artifact>.XXXXXXXX files;
    the next compile into the folder removes those an hour old, and nothing of the user's."""
    import os

    from purlinc import cachefiles

    status, out, err = _compile(capsys, EXAMPLES / "allreduce.pln", "-R", "2", "-o", tmp_path)
    assert status == 0, err
    artifacts = [Path(line).name for line in out.splitlines()]
    stale = [tmp_path / f".{name}.tmp-ab_cd012" for name in artifacts]
    fresh = tmp_path / f".{artifacts[0]}.tmp-zz_zz999"  # a concurrent compile's, about to be renamed
    users = [tmp_path / ".notes.txt.abcdefgh", tmp_path / f".{artifacts[0]}.mine",
             tmp_path / f".{artifacts[0]}.20241205"]  # a dated backup: mkstemp's shape, not our mark
    old = os.stat(tmp_path).st_mtime - cachefiles.STALE_TEMP_S - 60
    for path in (*stale, fresh, *users):
        path.write_bytes(b"half")
        if path is not fresh:
            os.utime(path, (old, old))
    status, out, err = _compile(capsys, EXAMPLES / "allreduce.pln", "-R", "2", "-o", tmp_path)
    assert status == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*artifacts, fresh.name, *(p.name for p in users)])


def test_compiles_for_two_archs_share_a_directory(tmp_path, capsys):
    """Two targets into one -o: each keeps its own CUDA source, CUBIN, schedule and manifest.
    Before, the files were named by the kernel alone, so the second compile replaced the
    first's (the sm_90 manifest and CUBIN were gone)."""
    sets = {}
    for arch in ("sm_90", "sm_100"):
        status, out, err = _compile(capsys, EXAMPLES / "allgather.pln", "-R", "2", "--arch", arch, "-o", tmp_path)
        assert status == 0, err
        sets[arch] = {Path(line).name: Path(line).read_bytes() for line in out.splitlines()}
    assert not set(sets["sm_90"]) & set(sets["sm_100"])
    on_disk = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert on_disk == sets["sm_90"] | sets["sm_100"]
    for arch, written in sets.items():
        (manifest_name,) = [name for name in written if name.endswith(".manifest.json")]
        manifest = json.loads(written[manifest_name])
        assert manifest["arch"] == arch
        assert {name for name in manifest["files"].values()} | {manifest_name} == set(written)
        assert written[manifest["files"]["cubin"]][:4] == b"\x7fELF"
    assert sets["sm_90"][f"{manifest['kernel_base']}.sm_90.cubin"] != sets["sm_100"][f"{manifest['kernel_base']}.sm_100.cubin"]


def test_a_cache_dir_that_is_a_file_is_warned_of(tmp_path, capsys, monkeypatch):
    """PURLIN_CACHE_DIR naming a file: the cache skipped itself with no word (a log line at INFO)."""
    (tmp_path / "cache").write_text("")
    monkeypatch.setenv("PURLIN_CACHE_DIR", str(tmp_path / "cache"))
    status, out, err = _compile(capsys, EXAMPLES / "allgather.pln", "-R", "2", "-o", tmp_path / "out")
    assert status == 0 and len(out.splitlines()) == 4
    assert err == (f"warning: the compile cache {tmp_path / 'cache'} cannot be written (it is not a directory): "
                   "compiling without it (set PURLIN_CACHE_DIR, or PURLIN_NO_CACHE=1)\n")
    monkeypatch.setenv("PURLIN_NO_CACHE", "1")  # asked for no cache: nothing to warn of
    status, out, err = _compile(capsys, EXAMPLES / "allgather.pln", "-R", "2", "-o", tmp_path / "out")
    assert (status, err) == (0, "")


def test_a_read_only_cache_is_said_to_serve_its_entries(tmp_path, monkeypatch):
    """A cache that cannot be written still serves what it holds: the warning said "compiling
    without it" while every compile hit."""
    from purlinc.cli.compile import cache_warning

    monkeypatch.setenv("PURLIN_CACHE_DIR", str(tmp_path))
    assert cache_warning(f"{tmp_path} is not writable") == (
        f"warning: the compile cache {tmp_path} cannot be written ({tmp_path} is not writable): entries it holds "
        "are used, new ones are not stored (set PURLIN_CACHE_DIR, or PURLIN_NO_CACHE=1)")
    monkeypatch.setenv("PURLIN_CACHE_DIR", str(tmp_path / "missing" / "cache"))
    assert "compiling without it" in cache_warning("x")


def test_an_unreachable_cache_or_output_dir_is_a_problem_not_a_crash(tmp_path, monkeypatch):
    """A path through a folder this user cannot search: Path.is_dir() raised PermissionError,
    and compile failed instead of warning (the cache) or naming -o (the output)."""
    import pathlib

    from purlinc.cli.compile import cache_problem, output_dir_problem

    blocked = tmp_path / "noexec" / "sub"

    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setenv("PURLIN_CACHE_DIR", str(blocked))
    monkeypatch.delenv("PURLIN_NO_CACHE", raising=False)
    monkeypatch.setattr(pathlib.Path, "is_dir", denied)
    monkeypatch.setattr(pathlib.Path, "exists", denied)
    monkeypatch.setattr("os.path.lexists", lambda path: True)
    assert cache_problem() == "it cannot be reached (Permission denied)"  # in the warning, after the path
    assert output_dir_problem(blocked) == f"{blocked} cannot be reached: Permission denied"


@pytest.mark.parametrize("blocker", ["name too long", "a file where front goes"])
def test_compile_warns_of_a_cache_the_permission_check_passes_but_no_write_can_reach(tmp_path, monkeypatch, blocker):
    """access() said yes to these, so compile warned of nothing and every entry was lost."""
    from purlinc.cli.compile import cache_problem, cache_warning

    monkeypatch.delenv("PURLIN_NO_CACHE", raising=False)
    if blocker == "name too long":
        where = tmp_path / ("x" * 300) / "c"
        expected = "File name too long"
    else:
        where = tmp_path / "cache"
        where.mkdir()
        (where / "front").write_text("a file of the user's")
        expected = "File exists"
    monkeypatch.setenv("PURLIN_CACHE_DIR", str(where))
    problem = cache_problem()
    assert problem is not None and expected in problem
    assert problem == f"its folder front: {expected}"  # the cache's path said once, not twice
    assert cache_warning(problem).startswith(f"warning: the compile cache {where} cannot be written (its folder")


def test_no_home_directory_skips_the_cache_with_a_warning(tmp_path, monkeypatch):
    """A container run as a uid with no passwd entry and no HOME: Path.home() raised, and every
    command stopped with an internal error."""
    import pwd

    from purlinc import settings
    from purlinc.cli.compile import cache_problem, cache_warning

    for name in ("PURLIN_CACHE_DIR", "PURLIN_NO_CACHE", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)

    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    assert not settings.cache_enabled()
    problem = cache_problem()
    assert problem.startswith("no home directory is known")
    assert cache_warning(problem).startswith("warning: the compile cache cannot be used (no home directory")
    monkeypatch.setenv("HOME", "relative/home")  # not a place either (it made ./relative/home/.cache)
    assert not settings.cache_enabled()
    monkeypatch.setenv("HOME", str(tmp_path))
    assert settings.cache_enabled() and settings.cache_dir() == tmp_path / ".cache" / "purlin"


@pytest.mark.parametrize("breakage,says", [
    # the atom's copy made ill-formed C++: NVRTC refuses what was generated
    (lambda text: text.replace("purlin_ldst_copy(dst, src, bytes);", "purlin_ldst_copy(dst, src, bytes) int;"),
     "NVRTC refused the CUDA generated for allgather's bfloat16 kernels (R=2, atom ldst, sm_90): a bug"),
    (lambda text: text + "{{ no_such_value }}", "template atom_ldst.cuh.j2: 'no_such_value' is undefined"),
    (lambda text: text + "{% if %}", "template atom_ldst.cuh.j2:"),
])
def test_a_kernel_the_generator_gets_wrong_is_reported_as_a_bug(tmp_path, capsys, monkeypatch, breakage, says):
    """Checked input yields code that compiles: where it does not (a template, or the CUDA it
    renders, is broken), that is purlinc's bug, exit 3 with a command that reproduces it, not a
    user error (exit 2) that named no bug and said nothing of what to do."""
    from purlinc.atom.codegen import render

    monkeypatch.setenv("PURLIN_NO_CACHE", "1")
    real = render.load_template
    monkeypatch.setattr(render, "load_template",
                        lambda name: breakage(real(name)) if name == "atom_ldst.cuh.j2" else real(name))
    render.environment.cache_clear()  # templates it loaded before the stand-in
    try:
        status, out, err = _compile(capsys, EXAMPLES / "allgather.pln", "-R", 2, "-o", tmp_path / "out")
    finally:
        render.environment.cache_clear()
    assert status == 3, err
    assert err.startswith("internal error (a bug in purlinc, not in your input): InternalError: ") and says in err
    assert "reproduce with: PURLIN_DEBUG=1 purlinc compile " in err
    assert out == "" and not (tmp_path / "out").exists()
    if "NVRTC refused" in says:
        kept = Path(err.split("generated source kept at ", 1)[1].split("\n", 1)[0])
        assert "purlin_ldst_copy(dst, src, bytes) int;" in kept.read_text()
        kept.unlink()
