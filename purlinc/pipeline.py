"""The compiler pipeline, one pure stage after another:

    .pln text -> ast -> spec -> snac schedule -> CUDA source -> CUBIN

``compile()`` reads as that list.  Nothing here needs a GPU: the target architecture is
an explicit argument.  The runtime calls the same function at load time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from purlinc.dtypes import DType, ReduceOp
from purlinc.frontend import ast
from purlinc.frontend.check import check
from purlinc.frontend.parse import parse, read_source
from purlinc.frontend.spec import Spec
from purlinc.snac.ir import Algorithm, LowerOptions, Schedule

DEFAULT_WORLD_SIZE = 8
ARCHES = ("sm_80", "sm_90", "sm_100")


@dataclass(frozen=True)
class SourceText:
    text: str
    filename: str


def load_source(path_or_source: str | Path) -> SourceText:
    """A path to a .pln file, or .pln text itself (anything containing 'collective' and '{')."""
    if isinstance(path_or_source, Path) or (
        isinstance(path_or_source, str) and "{" not in path_or_source
    ):
        return SourceText(read_source(path_or_source), str(path_or_source))
    return SourceText(path_or_source, "<string>")


def parse_stage(source: SourceText) -> ast.CollectiveDef:
    return parse(source.text, source.filename)


def spec_stage(definition: ast.CollectiveDef, world_size: int, params: Mapping[str, int] | None) -> Spec:
    return check(definition, world_size, params)


def snac_stage(spec: Spec, options: LowerOptions, *, verify: bool = True) -> Schedule:
    from purlinc.snac.lower import lower
    from purlinc.snac.verify import verify as verify_schedule

    schedule = lower(spec, options)
    if verify:
        verify_schedule(schedule, spec)
    return schedule


def default_options(spec: Spec) -> LowerOptions:
    """The options a plain call uses when none are given (the runtime may tune per size)."""
    from purlinc.snac.lower import default_options as choose

    return choose(spec)


@dataclass(frozen=True)
class Artifact:
    """Everything ``purlinc compile`` writes."""

    spec: Spec
    schedule: Schedule
    cuda: "object"  # purlinc.atom.codegen.KernelSource
    cubin: bytes | None
    arch: str
    atom: str
    dtype: DType
    op: ReduceOp | None


def compile(
    path_or_source: str | Path,
    *,
    world_size: int = DEFAULT_WORLD_SIZE,
    params: Mapping[str, int] | None = None,
    arch: str = "sm_90",
    options: LowerOptions | None = None,
    algorithm: Algorithm | str | None = None,
    atom: str = "ldst",
    dtype: DType | str = DType.BFLOAT16,
    op: ReduceOp | str | None = ReduceOp.SUM,
    emit_cubin: bool = True,
) -> Artifact:
    from purlinc.atom.codegen import generate
    from purlinc.atom.nvrtc import compile_cubin

    dtype = dtype if isinstance(dtype, DType) else DType.parse(dtype)
    source = load_source(path_or_source)
    definition = parse_stage(source)
    spec = spec_stage(definition, world_size, params)
    reduce_op = ReduceOp.parse(op) if spec.is_reduce else None
    if options is None:
        options = default_options(spec)
    if algorithm is not None:
        from dataclasses import replace

        options = replace(options, algorithm=Algorithm(algorithm) if isinstance(algorithm, str) else algorithm)
    schedule = snac_stage(spec, options)
    kernel = generate(schedule, spec, atom=atom, arch=arch, dtype=dtype, op=reduce_op)
    cubin = compile_cubin(kernel.source, kernel.filename, arch) if emit_cubin else None
    return Artifact(spec, schedule, kernel, cubin, arch, atom, dtype, reduce_op)
