"""purlinc.jsontext: the compile's and dump's JSON, one line per container that fits."""

import json
import random

import pytest

from purlinc import jsontext


def _random_value(rng, depth=0):
    kind = rng.randrange(7 if depth < 4 else 4)
    if kind == 0:
        return rng.randrange(-10**6, 10**6)
    if kind == 1:
        return rng.choice(["", "x", "a \"quoted\" name\n", "é", "x[0][1] for r3"])
    if kind == 2:
        return rng.choice([None, True, False, 1.5, -0.0])
    if kind == 3:
        return rng.random()
    if kind == 4:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(12))]
    if kind == 5:
        return {rng.choice(["op", "src", "dst", "note", "k", str(n)]): _random_value(rng, depth + 1)
                for n in range(rng.randrange(8))}
    return [[rng.randrange(100)] * rng.randrange(4) for _ in range(rng.randrange(60))]


@pytest.mark.parametrize("seed", range(200))
def test_parses_to_what_json_dumps_parses_to(seed):
    rng = random.Random(seed)
    value = _random_value(rng)
    width = rng.choice([1, 20, 60, jsontext.WIDTH])
    assert json.loads(jsontext.dumps(value, width=width)) == json.loads(json.dumps(value))


def test_keys_that_are_not_strings_are_written_as_json_writes_them():
    value = {1: "a", None: "b", 2.5: "c", False: "d"}
    assert json.loads(jsontext.dumps(value)) == json.loads(json.dumps(value))
    assert json.loads(jsontext.dumps({"x": value}, width=10)) == json.loads(json.dumps({"x": value}))


def test_a_container_that_fits_is_one_line_and_a_larger_one_an_item_a_line():
    step = {"op": "stage", "src": ["in", 0, 1, 0], "dst": ["stage", 1, 1, 0], "note": "x[1] for r1"}
    text = jsontext.dumps({"rank": 0, "steps": [step] * 3}, width=100)
    assert text.splitlines() == [
        "{",
        '  "rank": 0,',
        '  "steps": [',
        '    {"op": "stage", "src": ["in", 0, 1, 0], "dst": ["stage", 1, 1, 0], "note": "x[1] for r1"},',
        '    {"op": "stage", "src": ["in", 0, 1, 0], "dst": ["stage", 1, 1, 0], "note": "x[1] for r1"},',
        '    {"op": "stage", "src": ["in", 0, 1, 0], "dst": ["stage", 1, 1, 0], "note": "x[1] for r1"}',
        "  ]",
        "}",
    ]
    assert jsontext.dumps({"units": [4, 4]}) == '{"units": [4, 4]}'


def _line_value(line):
    """A line's value without its key and comma: the text after ``"key": `` if it has one."""
    body = line.strip().rstrip(",")
    if body.startswith('"'):
        _, end = json.JSONDecoder().raw_decode(body)
        if body[end:end + 2] == ": ":
            return body[end + 2:]
    return body


@pytest.mark.parametrize("width", [10, 40, 100])
def test_a_line_past_the_width_holds_nothing_that_could_be_opened(width):
    rng = random.Random(width)
    for _ in range(50):
        for line in jsontext.dumps(_random_value(rng), width=width).splitlines():
            value = _line_value(line)
            if len(line) > width and value not in ("[", "{"):
                parsed = json.loads(value)
                assert not isinstance(parsed, (list, dict)) or not parsed, line


def test_empty_containers_and_scalars():
    for value in ([], {}, [[]], {"a": {}}, 0, "s", None, [None]):
        assert jsontext.dumps(value) == json.dumps(value)


def test_a_large_container_is_not_encoded_whole_before_it_is_opened(monkeypatch):
    """The schedule's shape: a small dict holding large lists.  Encoding every container
    whole before opening it would encode each step once per level above it."""
    steps = [{"op": "stage", "src": ["in", 0, n, 0], "dst": ["stage", 1, n, 0]} for n in range(20_000)]
    value = {"schema": 2, "programs": [{"rank": r, "steps": steps} for r in range(4)]}
    encoded = []
    encode = jsontext._ENCODE
    monkeypatch.setattr(jsontext, "_ENCODE", lambda v: encoded.append(encode(v)) or encoded[-1])
    text = jsontext.dumps(value)
    assert json.loads(text) == value
    assert sum(map(len, encoded)) < 1.2 * len(text)


def test_a_container_that_holds_itself_is_refused_as_json_refuses_it():
    looped = [1, 2]
    looped.append(looped)
    nested = {"x": [1] * 100}
    nested["self"] = nested
    for value in (looped, nested):
        with pytest.raises(ValueError, match="Circular reference detected"):
            json.dumps(value)
        with pytest.raises(ValueError, match="Circular reference detected"):
            jsontext.dumps(value, width=20)
