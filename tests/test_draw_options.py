"""``purlinc draw``: options the drawing would have dropped are refused (``--compare`` with
``--packed`` or ``--stage-copies 2`` none of its algorithms takes; ``--timeline`` with a trace),
a trace recorded with slots or registered buffers draws with no flag (they are read from its
options' key) and refuses flags that disagree, and bound parameters are named in the drawing."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from purlinc import pipeline
from purlinc.cli import main
from purlinc.snac.ir import Algorithm

from test_draw import EXAMPLES, NS, _fake_trace, _find


# ---- --compare with an option no compared algorithm takes --------------------------------

@pytest.mark.parametrize("flags, message, note", [
    (["--packed"], "--packed does not apply to ring, two-shot: packed (LL) stages are supported for direct-push "
     "only", "add it to --compare, or leave --packed out"),
    (["--stage-copies", "2"], "--stage-copies 2 does not apply to ring, two-shot: they lower to 1 staging copy",
     "two staging copies apply to direct-push only: add one to --compare, or leave --stage-copies out"),
])
def test_compare_refuses_an_option_none_of_its_algorithms_takes(tmp_path, capsys, flags, message, note):
    """Exit 0 and a drawing equal to the one without the flag, before."""
    out = tmp_path / "c.svg"
    argv = ["draw", str(EXAMPLES / "allreduce.pln"), "-R", "4", "--compare", "ring,two-shot", *flags, "-o", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: {message}" in err and "note: " in err and note in err, err
    assert not out.exists()


@pytest.mark.parametrize("flags", [["--packed"], ["--stage-copies", "2"]])
def test_compare_takes_an_option_one_of_its_algorithms_takes(tmp_path, flags):
    out = tmp_path / "c.svg"
    argv = ["draw", str(EXAMPLES / "allreduce.pln"), "-R", "4", "--compare", "ring,direct-push", *flags, "-o", str(out)]
    assert main(argv) == 0
    subtitles = [t.text for t in ET.fromstring(out.read_text()).iter(NS + "text") if (t.text or "").startswith("R=4")]
    wanted = "packed (LL)" if flags == ["--packed"] else "2 staging copies"
    assert [wanted in s for s in subtitles] == [False, True]  # ring's panel, direct-push's


# ---- traces with slots and registered buffers ---------------------------------------------

def _slotted_trace(tmp_path):
    """A ring trace run with two slots per edge and registered inputs: both are in its
    options' key alone."""
    spec = pipeline.spec_stage(pipeline.parse_stage(pipeline.load_source(EXAMPLES / "allreduce.pln")), 2, {})
    options = pipeline.resolve_options(spec, overrides={"algorithm": Algorithm.RING, "slots": 2,
                                                        "registered": frozenset({"in"})})
    data = _fake_trace(pipeline.snac_stage(spec, options))
    assert data["options"]["key"] == "ring/c1/s1/slots2/regin" and "slots" not in data["options"]
    path = tmp_path / "ring.json"
    path.write_text(json.dumps(data))
    return path


def test_a_trace_with_slots_and_registered_buffers_draws_without_flags(tmp_path, capsys):
    """Before: refused, blaming the .pln ("but the file gives ... slotsall/reg-") until the
    user guessed --slots 2 --registered in."""
    path = _slotted_trace(tmp_path)
    out = tmp_path / "t.svg"
    assert main(["draw", str(EXAMPLES / "allreduce.pln"), "--trace", str(path), "-o", str(out)]) == 0, \
        capsys.readouterr().err
    subtitle = [t.text for t in ET.fromstring(out.read_text()).iter(NS + "text") if (t.text or "").startswith("R=2")]
    assert "2 staging slots per edge, registered in" in subtitle[0]
    # flags that agree with the trace are accepted
    argv = ["draw", str(EXAMPLES / "allreduce.pln"), "--trace", str(path), "--slots", "2", "--registered", "in"]
    assert main(argv + ["-o", str(out)]) == 0


@pytest.mark.parametrize("argv, message", [
    (["--slots", "3"], "--slots 3 (the trace ran --slots 2)"),
    (["--registered", "out"], "--registered out (the trace ran --registered in)"),
    (["--registered", "both"], "--registered both (the trace ran --registered in)"),
])
def test_a_trace_refuses_slots_and_registered_that_differ(tmp_path, capsys, argv, message):
    path = _slotted_trace(tmp_path)
    assert main(["draw", str(EXAMPLES / "allreduce.pln"), "--trace", str(path), *argv]) == 2
    err = capsys.readouterr().err
    assert f"trace {path} fixes the schedule it was recorded with" in err and message in err, err


def test_a_trace_without_slots_refuses_slots(tmp_path, capsys):
    """--slots on a trace run without them was dropped silently."""
    from purlinc.snac.ir import LowerOptions

    spec = pipeline.spec_stage(pipeline.parse_stage(pipeline.load_source(EXAMPLES / "allreduce.pln")), 2, {})
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_fake_trace(pipeline.snac_stage(spec, LowerOptions(algorithm=Algorithm.RING)))))
    assert main(["draw", str(EXAMPLES / "allreduce.pln"), "--trace", str(path), "--slots", "2"]) == 2
    assert "--slots 2 (the trace ran no --slots)" in capsys.readouterr().err


def test_a_trace_refuses_timeline(tmp_path, capsys):
    path = _slotted_trace(tmp_path)
    assert main(["draw", str(EXAMPLES / "allreduce.pln"), "--trace", str(path), "--timeline"]) == 2
    assert ("error: --timeline lays the steps out by the cost model; a --trace lays them out by measured times: "
            "leave --timeline out") in capsys.readouterr().err


def test_a_trace_key_that_is_no_options_key_is_refused(tmp_path, capsys):
    data = json.loads(_slotted_trace(tmp_path).read_text())
    data["options"]["key"] = "ring"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    assert main(["draw", str(EXAMPLES / "allreduce.pln"), "--trace", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"trace file {path}: options.key: expected an options key like" in err and "internal error" not in err


# ---- bound parameters --------------------------------------------------------------------

def test_the_subtitle_names_bound_parameters(tmp_path):
    """broadcast at root 5 read exactly like broadcast at root 0."""
    out = tmp_path / "b.svg"
    assert main(["draw", str(EXAMPLES / "broadcast.pln"), "-R", "8", "-p", "root=5", "-o", str(out)]) == 0
    texts = [t.text or "" for t in ET.fromstring(out.read_text()).iter(NS + "text")]
    assert any(t.startswith("R=8, root=5, copy, ") for t in texts), texts[:3]
    assert main(["draw", str(EXAMPLES / "broadcast.pln"), "-R", "8", "-o", str(out)]) == 0
    assert "R=8, root=0, copy, " in out.read_text()  # the default is named too: the schedule depends on it


def test_the_plan_title_names_bound_parameters(tmp_path):
    out = tmp_path / "h.svg"
    argv = ["draw", str(EXAMPLES / "broadcast.pln"), "-R", "8", "-p", "root=5", "--gpus-per-node", "4", "-o", str(out)]
    assert main(argv) == 0
    title = ET.fromstring(out.read_text()).find(NS + "text").text
    assert title == "broadcast: 2 nodes x 4 GPUs (R=8), root=5, copy"


def test_a_drawing_without_parameters_names_none():
    from purlinc.draw.render import Request, render

    text = render(Request(file=str(EXAMPLES / "allreduce.pln"), world_size=2), "svg")
    root = ET.fromstring(text)
    assert any((t.text or "").startswith("R=2, reduce, direct-push") for t in root.iter(NS + "text"))
    assert _find(root, "g", "step")


def test_an_output_of_dash_is_standard_output(tmp_path, capsys, monkeypatch):
    """`-o -` wrote a file named '-' (dump reads '-' as standard input; a drawing's '-' is its output)."""
    monkeypatch.chdir(tmp_path)
    assert main(["draw", str(EXAMPLES / "allgather.pln"), "-R", "2", "--format", "html", "-o", "-"]) == 0
    out = capsys.readouterr().out
    assert out.lstrip().lower().startswith("<!doctype html") and not (tmp_path / "-").exists()
    assert main(["draw", str(EXAMPLES / "allgather.pln"), "-R", "2", "-o", "-"]) == 0
    assert capsys.readouterr().out.lstrip().startswith("<svg")
