"""``purlinc compile``'s output: the CUDA source, the CUBIN, the schedule and a manifest.

The manifest is what a runtime (or a person) needs to launch the kernels without the
compiler: entry points, launch geometry, the ABI, buffer sizes and the versions involved.
"""

from __future__ import annotations

import json
import os
import tempfile
from importlib import metadata
from pathlib import Path

import purlinc
from purlinc.atom.nvrtc import nvrtc_version

MANIFEST_SCHEMA = 1


def _schedule_json(schedule) -> dict:
    try:
        from purlinc.snac.format import schedule_to_json
    except ImportError:  # pragma: no cover - only before the SNAC dump existed
        from purlinc.atom.codegen.names import canonical

        return canonical(schedule)
    return schedule_to_json(schedule)


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
            "stage_units": schedule.stage_units,
            "signal_pad": schedule.signal_pad_size(),
        },
        "files": {
            "cuda": kernel.filename,
            "cubin": f"{kernel.kernel_base}.cubin" if artifact.cubin is not None else None,
            "schedule": f"{kernel.kernel_base}.schedule.json",
        },
        "versions": {
            "purlinc": purlinc.__version__,
            "nvrtc": nvrtc_version(),
            "cuda-bindings": _package_version("cuda-bindings"),
        },
    }


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    return mask


def _write(path: Path, data: bytes) -> None:
    """Temporary file + rename: a reader never sees half an artifact."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        # mkstemp creates 0600; artifacts are ordinary files (0644 under the usual umask).
        os.chmod(temp, 0o666 & ~_umask())
        os.replace(temp, path)
    except BaseException:
        os.unlink(temp)
        raise


def write_artifacts(artifact, out_dir: Path, *, ranks_defaulted: bool) -> list[Path]:
    """Write ``<kernel_base>.cu``, ``.cubin``, ``.schedule.json`` and ``.manifest.json``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = artifact.cuda.kernel_base
    files: list[tuple[Path, bytes]] = [(out_dir / artifact.cuda.filename, artifact.cuda.source.encode())]
    if artifact.cubin is not None:
        files.append((out_dir / f"{base}.cubin", artifact.cubin))
    files.append((out_dir / f"{base}.schedule.json", _json_bytes(_schedule_json(artifact.schedule))))
    files.append((out_dir / f"{base}.manifest.json", _json_bytes(manifest(artifact, ranks_defaulted=ranks_defaulted))))
    for path, data in files:
        _write(path, data)
    return [path for path, _ in files]


def _json_bytes(value) -> bytes:
    return (json.dumps(value, indent=2) + "\n").encode()
