"""``purlinc compile``'s output: the CUDA source, the CUBIN, the schedule and a manifest.

The manifest is what a runtime (or a person) needs to launch the kernels without the
compiler: entry points, launch geometry, the ABI, buffer sizes and the versions involved.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from importlib import metadata
from pathlib import Path

from purlinc import jsontext
from purlinc.cachefiles import remove_stale_temps, temp_names
from purlinc.atom.nvrtc import nvrtc_version
from purlinc.version import __version__

MANIFEST_SCHEMA = 1


def _schedule_json(schedule) -> dict:
    from purlinc.snac.format import schedule_to_json

    return schedule_to_json(schedule)


def artifact_stem(kernel) -> str:
    """``<kernel_base>.<arch>``: what every file of one compile is named by.  The kernel base
    hashes the schedule, atom, dtype and op but not the target (the entry points inside the
    CUBIN are the same on every arch), so without the arch a compile for sm_100 into the
    directory of one for sm_90 replaced its CUBIN and manifest."""
    return f"{kernel.kernel_base}.{kernel.arch}"


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def manifest(artifact, *, ranks_defaulted: bool) -> dict:
    kernel = artifact.cuda
    schedule = artifact.schedule
    abi = kernel.abi
    return {
        "schema": MANIFEST_SCHEMA,
        "collective": artifact.collective,
        "ranks": schedule.world_size,
        "ranks_defaulted": ranks_defaulted,
        "params": dict(artifact.params),
        "operation": schedule.operation.value,
        "arch": kernel.arch,
        "atom": artifact.atom,
        "dtype": artifact.dtype.value,
        "op": artifact.op.value if artifact.op else None,
        "algorithm": schedule.options.algorithm.value,
        "options_key": schedule.options.key(),
        "kernel_base": kernel.kernel_base,
        "entries": [abi.entry(rank) for rank in range(abi.world_size)],
        "launch": {"grid": [abi.channels, 1, 1], "block": [abi.threads, 1, 1], "shared_bytes": abi.shared_bytes},
        "abi": abi.to_json(),
        "buffers": {
            "unit": "chunks (count elements) for in/out; pieces (piece elements) for stage",
            "in_units": list(schedule.in_units),
            "out_units": list(schedule.out_units),
            # per staging copy: a rank's staging holds stage_copies x stage_units pieces (the ABI's stage_units)
            "stage_units": schedule.stage_units,
            "stage_copies": schedule.stage_copies,
            "signal_pad": schedule.signal_pad_size(),
        },
        "files": {name: path.name if path else None for name, path in artifact_paths(artifact, Path()).items()},
        "versions": {
            "purlinc": __version__,
            "nvrtc": nvrtc_version(),
            "cuda-bindings": _package_version("cuda-bindings"),
        },
    }


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    return mask


# Between an artifact's name and mkstemp's eight characters in its temporary file's name: the
# sweep of killed compiles' temporaries removes only names with it (not a user's dated backup,
# .<artifact>.20241205, in the same folder).
_TEMP_MARK = ".tmp-"


def _staged(path: Path, data: bytes) -> str:
    """``data`` in a temporary file beside ``path`` (renamed into place by the caller); an
    error names ``path``, not the temporary file."""
    try:
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}{_TEMP_MARK}")
    except OSError as error:
        raise OSError(error.errno, error.strerror, str(path)) from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        # mkstemp creates 0600; artifacts are ordinary files (0644 under the usual umask).
        os.chmod(temp, 0o666 & ~_umask())
    except BaseException as error:
        os.unlink(temp)
        if isinstance(error, OSError):
            raise OSError(error.errno, error.strerror, str(path)) from None
        raise
    return temp


def _check_replaceable(path: Path) -> None:
    """A directory (or another non-file) where an artifact goes would stop its rename after
    the artifacts before it were replaced: refused before any is written (a link is replaced)."""
    if os.path.lexists(path) and not (os.path.islink(path) or os.path.isfile(path)):
        raise OSError(errno.EEXIST, "not a file, so the artifact cannot replace it", str(path))


def artifact_paths(artifact, out_dir: Path) -> dict[str, Path | None]:
    """Where each file the manifest lists goes (``cubin`` None when none was compiled)."""
    stem = artifact_stem(artifact.cuda)
    return {
        "cuda": out_dir / f"{stem}.cu",
        "cubin": out_dir / f"{stem}.cubin" if artifact.cubin is not None else None,
        "schedule": out_dir / f"{stem}.schedule.json",
    }


def write_artifacts(artifact, out_dir: Path, *, ranks_defaulted: bool) -> list[Path]:
    """Write ``<kernel_base>.<arch>.cu``, ``.cubin``, ``.schedule.json`` and ``.manifest.json``,
    all or none: every file is checked and written to a temporary file first, then each is
    renamed into place (a reader never sees half an artifact, nor a set from two compiles after
    an error)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = artifact_paths(artifact, out_dir)
    files: list[tuple[Path, bytes]] = [(paths["cuda"], artifact.cuda.source.encode())]
    if paths["cubin"] is not None:
        files.append((paths["cubin"], artifact.cubin))
    files.append((paths["schedule"], _json_bytes(_schedule_json(artifact.schedule))))
    files.append((out_dir / f"{artifact_stem(artifact.cuda)}.manifest.json",
                  _json_bytes(manifest(artifact, ranks_defaulted=ranks_defaulted))))
    for path, _ in files:
        _check_replaceable(path)
    remove_stale_temps(out_dir, temp_names([f".{path.name}{_TEMP_MARK}" for path, _ in files]))
    temps: list[str] = []
    try:
        for path, data in files:
            temps.append(_staged(path, data))
    except BaseException:
        for temp in temps:
            os.unlink(temp)
        raise
    renamed = 0
    try:
        for temp, (path, _) in zip(temps, files):
            os.replace(temp, path)
            renamed += 1
    except BaseException as error:  # Ctrl-C between two renames too: no temporary file is left
        for left in temps[renamed:]:
            with contextlib.suppress(FileNotFoundError):  # renamed just before the interrupt
                os.unlink(left)
        if isinstance(error, OSError):
            raise OSError(error.errno, error.strerror, str(files[renamed][0])) from None
        raise
    return [path for path, _ in files]


def _json_bytes(value) -> bytes:
    return (jsontext.dumps(value) + "\n").encode()
