"""One registry each for atoms, algorithms and dtypes: every consumer reads the same records,
an unknown name is a clear error that lists the registry's names, and the records agree with
the code they describe (lowering functions, applicability, codegen's element types)."""

from __future__ import annotations

from pathlib import Path

import pytest

from purlinc import pipeline
from purlinc.atom import atoms
from purlinc.dtypes import DTYPES, DType
from purlinc.errors import PurlinError
from purlinc.registry import Registry, UnknownNameError
from purlinc.snac import algorithms
from purlinc.snac.ir import Algorithm

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


# ---- lookups and errors ----------------------------------------------------------------

@pytest.mark.parametrize("lookup, name, kind, names", [
    (atoms.lookup_atom, "multimem", "atom", ("ldst", "tma", "ce")),
    (algorithms.get_algorithm, "tree", "algorithm", ("direct-push", "direct-pull", "two-shot", "ring")),
    (DType.parse, "float64", "dtype", tuple(d.value for d in DType)),
])
def test_unknown_name_lists_the_registry(lookup, name, kind, names):
    with pytest.raises(UnknownNameError) as caught:
        lookup(name)
    error = caught.value
    assert isinstance(error, PurlinError) and isinstance(error, ValueError)
    assert error.render() == f"error: unknown {kind} {name!r}\nnote: expected one of: {', '.join(names)}"


def test_registry_refuses_duplicates_and_dangling_aliases():
    class R:
        def __init__(self, name):
            self.name = name

    with pytest.raises(ValueError, match="registered twice"):
        Registry("thing", [R("a"), R("a")])
    with pytest.raises(ValueError, match="unknown names"):
        Registry("thing", [R("a")], aliases={"b": "c"})
    registry = Registry("thing", [R("a"), R("b")], aliases={"alpha": "a"})
    assert registry.names() == ("a", "b") and registry.get("ALPHA").name == "a" and "b" in registry


def test_runtime_prepare_reports_unknown_atom_and_algorithm():
    from purlinc.runtime.collective import prepare

    with pytest.raises(UnknownNameError, match="unknown atom 'nvls'") as caught:
        prepare(EXAMPLES / "allgather.pln", 2, atom="nvls")
    assert "ldst, tma, ce" in caught.value.render()
    with pytest.raises(UnknownNameError, match="unknown algorithm 'tree'") as caught:
        prepare(EXAMPLES / "allgather.pln", 2, algorithm="tree")
    assert "direct-push, direct-pull, two-shot, ring" in caught.value.render()


def test_unknown_lowering_option_names_the_fields():
    with pytest.raises(PurlinError, match="unknown lowering option") as caught:
        pipeline.prepare(EXAMPLES / "allgather.pln", world_size=2, overrides={"chanels": 2}).prepared()
    assert "channels" in caught.value.render()


# ---- atoms -----------------------------------------------------------------------------

def test_atom_records():
    ldst, tma, ce = (atoms.lookup_atom(n) for n in ("ldst", "tma", "ce"))
    assert atoms.ATOMS.names() == ("ldst", "tma", "ce") and atoms.DEFAULT_ATOM == "ldst"
    assert ldst.generates_kernels and tma.generates_kernels and not ce.generates_kernels
    assert (ldst.reduces, tma.reduces, ce.reduces) == (True, True, False)
    assert (ldst.packed, ce.packed) == (True, False) and not ce.uses_sms
    assert tma.shared_bytes(atoms.parse_arch("sm_90")) > 0 and ldst.shared_bytes(atoms.parse_arch("sm_90")) == 0
    assert atoms.applicable_atoms("sm_80") == ("ldst",)
    assert atoms.applicable_atoms("sm_90", kernels=False) == ("ldst", "tma", "ce")
    assert atoms.kernel_atoms() == ("ldst", "tma")
    assert ce.host_module().Runner.__name__ == "CeRunner" and ldst.host_module() is None


def test_codegen_refuses_an_atom_without_kernels():
    with pytest.raises(PurlinError, match="atom 'ce' runs without kernels"):
        atoms.get_atom("ce", "sm_90")
    assert atoms.get_atom("ce", "sm_90", kernels=False).name == "ce"


def test_cli_choices_come_from_the_registries():
    from purlinc import cli

    parser = cli.build_parser()
    compile_parser = parser._subparsers._group_actions[0].choices["compile"]
    choices = {a.dest: a.choices for a in compile_parser._actions if a.choices}
    assert tuple(choices["atom"]) == atoms.kernel_atoms()
    assert tuple(choices["algorithm"]) == algorithms.ALGORITHMS.names()


def test_ce_atom_lives_in_the_atom_layer_and_imports_no_runtime():
    import ast as python_ast

    path = Path(atoms.__file__).with_name("ce.py")
    tree = python_ast.parse(path.read_text())
    imported = {node.module for node in python_ast.walk(tree) if isinstance(node, python_ast.ImportFrom)}
    imported |= {a.name for node in python_ast.walk(tree) if isinstance(node, python_ast.Import) for a in node.names}
    assert not any(name and name.startswith("purlinc.runtime") for name in imported), imported
    assert not (Path(atoms.__file__).parents[1] / "runtime" / "ce.py").exists()


def test_ce_refuses_packed_schedules():
    from purlinc.atom.ce import CeError
    from purlinc.runtime.collective import prepare

    with pytest.raises(CeError, match="packed"):
        prepare(EXAMPLES / "allgather.pln", 2, atom="ce", packed=True)


# ---- algorithms ------------------------------------------------------------------------

def test_algorithm_records_match_the_lowering():
    from purlinc.snac import lower

    assert {r.algorithm for r in algorithms.ALGORITHMS.records()} == set(Algorithm)
    for record in algorithms.ALGORITHMS.records():
        assert record.lower_function() is lower._LOWERINGS[record.algorithm], record.name
    assert [r.name for r in algorithms.ALGORITHMS.records() if r.packed] == ["direct-push"]
    assert algorithms.get_algorithm(Algorithm.RING).uses_slots


@pytest.mark.parametrize("name", sorted(p.stem for p in EXAMPLES.glob("*.pln")))
@pytest.mark.parametrize("world_size", [2, 4, 6])
def test_applicability_matches_the_lowering(name, world_size):
    from purlinc.snac.lower import applicable_algorithms

    source = pipeline.load_source(EXAMPLES / f"{name}.pln")
    spec = pipeline.spec_of(source, world_size, None)  # every example applies at even R
    assert algorithms.applicable(spec) == applicable_algorithms(spec)


# ---- dtypes ----------------------------------------------------------------------------

def test_dtype_records():
    assert tuple(DTYPES) == tuple(d.value for d in DType)
    for dtype in DType:
        info = dtype.info
        assert info.dtype is dtype and info.itemsize == dtype.storage.itemsize
        assert dtype.reducible == (info.c_acc is not None)
    assert DType.parse("bf16") is DType.BFLOAT16 and DType.parse("torch.float8_e4m3fn") is DType.FLOAT8_E4M3
    assert DType.parse(DType.INT32) is DType.INT32
    assert not DType.FLOAT8_E5M2.reducible and DType.INT32.info.c_ops == "i"


def test_codegen_element_types_agree_with_the_dtype_registry():
    """codegen keeps its own table until it reads the registry; they must not drift."""
    from purlinc.atom.codegen.elems import ELEMS

    for dtype, elem in ELEMS.items():
        info = dtype.info
        assert (elem.storage, elem.acc or None, elem.suffix, elem.ops) == (
            info.c_storage, info.c_acc, info.c_suffix, info.c_ops), dtype


def test_interop_tables_come_from_the_dtype_registry():
    from purlinc.runtime import interop

    assert interop._DL_DTYPES[(4, 16)] is DType.BFLOAT16 and len(interop._DL_DTYPES) == len(DTYPES)
    assert interop._TYPESTR == {"<f4": DType.FLOAT32, "<f2": DType.FLOAT16, "<i4": DType.INT32, "<i8": DType.INT64}
