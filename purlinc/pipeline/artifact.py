"""``compile``: one kernel of a Compiled, as ``purlinc compile`` writes it (an ``Artifact``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from purlinc.atom.atoms import DEFAULT_ATOM
from purlinc.pipeline.compiled import DEFAULT_WORLD_SIZE, Compiled, prepare
from purlinc.pipeline.entries import Kernel
from purlinc.pipeline.source import SourceText

if TYPE_CHECKING:
    from purlinc.dtypes import DType, ReduceOp
    from purlinc.frontend.spec import Spec
    from purlinc.snac.ir import Algorithm, LowerOptions, Schedule


class Artifact:
    """Everything ``purlinc compile`` writes: a Compiled and one of its kernels."""

    __slots__ = ("compiled", "kernel", "dtype", "op", "from_cache")

    def __init__(self, compiled: Compiled, kernel: Kernel, *, from_cache: bool):
        self.compiled = compiled
        self.kernel = kernel
        self.dtype: DType = kernel.cuda.dtype
        self.op: ReduceOp | None = kernel.cuda.op
        self.from_cache = from_cache

    @property
    def spec(self) -> Spec:
        return self.compiled.spec

    @property
    def schedule(self) -> Schedule:
        return self.compiled.schedule

    @property
    def cuda(self):
        return self.kernel.cuda

    @property
    def cubin(self) -> bytes | None:
        return self.kernel.cubin

    @property
    def arch(self) -> str:
        return self.compiled.arch

    @property
    def atom(self) -> str:
        return self.compiled.atom

    @property
    def collective(self) -> str:
        return self.kernel.collective

    @property
    def params(self) -> dict[str, int]:
        return dict(self.kernel.params)


def compile(
    path_or_source: str | Path | SourceText,
    *,
    world_size: int = DEFAULT_WORLD_SIZE,
    params: Mapping[str, int] | None = None,
    arch: str = "sm_90",
    options: LowerOptions | None = None,
    overrides: Mapping[str, object] | None = None,
    algorithm: Algorithm | str | None = None,
    atom: str = DEFAULT_ATOM,
    dtype: DType | str = "bfloat16",
    op: ReduceOp | str | None = "sum",
    emit_cubin: bool = True,
) -> Artifact:
    """Compile one collective for one world size, target, dtype and op: ``prepare`` + ``kernel``."""
    compiled = prepare(path_or_source, world_size=world_size, params=params, arch=arch, atom=atom, options=options,
                       overrides=overrides, algorithm=algorithm)
    kernel, hit = compiled.kernel_and_hit(dtype, op, emit_cubin=emit_cubin)
    return Artifact(compiled, kernel, from_cache=hit)
