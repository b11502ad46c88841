"""manylora.engine.requests.parsing: Triton tensors (numpy, with the batch dimension) -> GenerationRequest.

Fuzzed with hypothesis: whatever the dtypes, shapes, values or bytes, the result is a
GenerationRequest or a RequestError with a message naming the input; never another exception.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from manylora.engine.errors import ErrorCode, RequestError
from manylora.engine.requests.parsing import (
    INT32_MAX,
    MAX_STOP_STRINGS,
    parse_control,
    parse_generation,
    sampling_params,
)
from manylora.engine.requests.types import GenerationRequest

INPUT_NAMES = ("input_ids", "max_tokens", "lora_name", "stream", "temperature", "top_k", "top_p", "seed", "stop")
SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def good(**overrides) -> dict:
    inputs = {
        "input_ids": np.array([[0, 5, 9]], dtype=np.int32),
        "max_tokens": np.array([[8]], dtype=np.int32),
        "lora_name": np.array([[b"shout"]], dtype=np.object_),
        "stream": np.array([[True]]),
        "temperature": np.array([[0.7]], dtype=np.float32),
        "top_k": np.array([[5]], dtype=np.int32),
        "top_p": np.array([[0.9]], dtype=np.float32),
        "seed": np.array([[42]], dtype=np.uint64),
        "stop": np.array([[b"\n", b"END"]], dtype=np.object_),
    }
    inputs.update(overrides)
    return {k: v for k, v in inputs.items() if v is not None}


def refused(inputs: dict, *words: str) -> str:
    with pytest.raises(RequestError) as info:
        parse_generation(inputs, "r")
    assert info.value.code == ErrorCode.INVALID_ARG
    for word in words:
        assert word in info.value.message, info.value.message
    return info.value.message


def test_a_good_request():
    req = parse_generation(good(), "r#1")
    assert req.request_id == "r#1" and req.prompt_ids == [0, 5, 9] and req.adapter == "shout" and req.stream
    s = req.sampling
    assert (s.max_tokens, s.top_k, s.seed, s.stop) == (8, 5, 42, ("\n", "END"))
    assert math.isclose(s.temperature, 0.7, rel_tol=1e-6) and math.isclose(s.top_p, 0.9, rel_tol=1e-6)


def test_only_input_ids():
    req = parse_generation({"input_ids": np.array([[3, 4]], dtype=np.int32)}, "r")
    assert req.adapter is None and req.stream is False and req.sampling.max_tokens == 16


def test_empty_adapter_name_is_the_base_model():
    assert parse_generation(good(lora_name=np.array([[b""]], dtype=np.object_)), "r").adapter is None


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ({"input_ids": None}, ["input_ids", "missing"]),
        ({"input_ids": np.array([[1.0, 2.0]], dtype=np.float32)}, ["input_ids", "integers"]),
        ({"input_ids": np.zeros((2, 3), dtype=np.int32)}, ["input_ids", "batch of one"]),
        ({"input_ids": np.zeros((1, 2, 3), dtype=np.int32)}, ["input_ids", "shape"]),
        ({"lora_name": np.array([[b"caf\xc3"]], dtype=np.object_)}, ["lora_name", "UTF-8"]),
        ({"lora_name": np.array([[b"a", b"b"]], dtype=np.object_)}, ["lora_name", "one value"]),
        ({"max_tokens": np.array([[2**40]], dtype=np.int64)}, ["max_tokens", str(INT32_MAX)]),
        ({"max_tokens": np.array([[0]], dtype=np.int32)}, ["max_tokens"]),
        ({"max_tokens": np.array([[1.5]], dtype=np.float32)}, ["max_tokens", "integer"]),
        ({"temperature": np.array([[np.nan]], dtype=np.float32)}, ["temperature", "finite"]),
        ({"temperature": np.array([[np.inf]], dtype=np.float32)}, ["temperature", "finite"]),
        ({"temperature": np.array([[-1.0]], dtype=np.float32)}, ["temperature", ">= 0"]),
        ({"top_p": np.array([[0.0]], dtype=np.float32)}, ["top_p"]),
        ({"top_k": np.array([[-1]], dtype=np.int32)}, ["top_k"]),
        ({"seed": np.array([[-5]], dtype=np.int64)}, ["seed"]),
        ({"stream": np.array([[2]], dtype=np.int32)}, ["stream", "boolean"]),
        ({"stop": np.array([[b"x"] * (MAX_STOP_STRINGS + 1)], dtype=np.object_)}, ["stop", "at most"]),
        ({"stop": np.array([[b"y" * 10_000]], dtype=np.object_)}, ["stop", "characters"]),
        ({"stop": np.array([[b"\xff"]], dtype=np.object_)}, ["stop", "UTF-8"]),
        ({"stop": np.array([[7]], dtype=np.int32)}, ["stop", "string"]),
    ],
)
def test_bad_inputs_are_refused_with_the_reason(override, words):
    refused(good(**override), *words)


def test_empty_stop_list_and_empty_strings():
    assert parse_generation(good(stop=np.zeros((1, 0), dtype=np.object_)), "r").sampling.stop == ()
    assert parse_generation(good(stop=np.array([[b"", b"x"]], dtype=np.object_)), "r").sampling.stop == ("x",)


def test_sampling_params_alone():
    assert sampling_params({}).max_tokens == 16
    assert sampling_params({"max_tokens": np.array([[INT32_MAX]], dtype=np.int32)}).max_tokens == INT32_MAX


# -- fuzzing ------------------------------------------------------------------------------

DTYPES = st.sampled_from([np.int8, np.int32, np.int64, np.uint8, np.uint64, np.float16, np.float32, np.float64,
                          np.bool_])
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)


@st.composite
def numeric_arrays(draw):
    return draw(hnp.arrays(draw(DTYPES), draw(SHAPES)))


@st.composite
def bytes_arrays(draw):
    shape = draw(SHAPES)
    size = int(np.prod(shape)) if shape else 1
    items = draw(st.lists(st.one_of(st.binary(max_size=40), st.text(max_size=20), st.integers()), min_size=size,
                          max_size=size))
    array = np.empty(size, dtype=np.object_)
    array[:] = items
    return array.reshape(shape)


ANY_ARRAY = st.one_of(numeric_arrays(), bytes_arrays(), st.none())


@SETTINGS
@given(st.fixed_dictionaries({}, optional={name: ANY_ARRAY for name in INPUT_NAMES}))
def test_fuzz_any_tensors(inputs):
    _parse_or_refuse(inputs)


@SETTINGS
@given(
    ids=hnp.arrays(st.sampled_from([np.int32, np.int64, np.uint64]), st.tuples(st.just(1), st.integers(0, 64))),
    max_tokens=st.integers(-(2**63), 2**63 - 1),
    temperature=st.floats(allow_nan=True, allow_infinity=True, width=32),
    top_p=st.floats(allow_nan=True, allow_infinity=True, width=32),
    top_k=st.integers(-(2**31), 2**31 - 1),
    seed=st.integers(-(2**63), 2**63 - 1),
    stop=st.lists(st.binary(max_size=300), max_size=20),
    name=st.binary(max_size=300),
)
def test_fuzz_well_shaped_values(ids, max_tokens, temperature, top_p, top_k, seed, stop, name):
    inputs = {
        "input_ids": ids,
        "max_tokens": np.array([[max_tokens]], dtype=np.int64),
        "temperature": np.array([[temperature]], dtype=np.float32),
        "top_p": np.array([[top_p]], dtype=np.float32),
        "top_k": np.array([[top_k]], dtype=np.int64),
        "seed": np.array([[seed]], dtype=np.int64),
        "stop": np.array([stop], dtype=np.object_).reshape(1, -1),
        "lora_name": np.array([[name]], dtype=np.object_),
    }
    req = _parse_or_refuse(inputs)
    if req is not None:
        s = req.sampling
        assert 1 <= s.max_tokens <= INT32_MAX and math.isfinite(s.temperature) and s.temperature >= 0
        assert 0 < s.top_p <= 1 and s.top_k >= 0 and 0 <= s.seed < 2**64 and len(s.stop) <= MAX_STOP_STRINGS


def _parse_or_refuse(inputs: dict) -> GenerationRequest | None:
    try:
        req = parse_generation(inputs, "fuzz")
    except RequestError as e:
        assert e.code == ErrorCode.INVALID_ARG
        assert e.message and any(name in e.message for name in INPUT_NAMES), e.message
        return None
    assert isinstance(req, GenerationRequest)
    assert all(isinstance(t, int) for t in req.prompt_ids)
    assert req.adapter is None or isinstance(req.adapter, str)
    return req


# -- control ------------------------------------------------------------------------------

def control(obj) -> np.ndarray:
    text = obj if isinstance(obj, (str, bytes)) else json.dumps(obj)
    return np.array([[text.encode() if isinstance(text, str) else text]], dtype=np.object_)


def test_control_ops():
    assert parse_control(control({"op": "stats"})) == {"op": "stats"}
    assert parse_control(control({"op": "list_adapters"})) == {"op": "list_adapters"}
    assert parse_control(control({"op": "load_adapter", "name": "a", "path": "/x"})) == {
        "op": "load_adapter", "name": "a", "path": "/x", "sha256": None, "replace": False}
    assert parse_control(control({"op": "load_adapter", "name": "a", "path": "/x", "sha256": "ab", "replace": True}))[
        "replace"] is True
    assert parse_control(control({"op": "unload_adapter", "name": "a"})) == {"op": "unload_adapter", "name": "a"}


@pytest.mark.parametrize(
    ("command", "words"),
    [
        ("not json", ["JSON"]),
        ([1, 2], ["JSON"]),
        ({"op": "nope"}, ["nope", "known"]),
        ({"op": "load_adapter", "path": "/x"}, ["name"]),
        ({"op": "load_adapter", "name": "a"}, ["path"]),
        ({"op": "load_adapter", "name": "a", "path": "/x", "replace": "yes"}, ["replace"]),
        ({"op": "load_adapter", "name": "a", "path": "/x", "sha256": 5}, ["sha256"]),
        ({"op": "unload_adapter"}, ["name"]),
        (b"\xff\xfe", ["UTF-8"]),
    ],
)
def test_bad_control_is_refused(command, words):
    with pytest.raises(RequestError) as info:
        parse_control(control(command))
    assert info.value.code == ErrorCode.INVALID_ARG
    for word in words:
        assert word in info.value.message


@SETTINGS
@given(st.one_of(bytes_arrays(), numeric_arrays(),
                 st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=10),
                              lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(
                                  ["op", "name", "path", "sha256", "replace"]), c, max_size=5)).map(control)))
def test_fuzz_control(value):
    try:
        command = parse_control(value)
    except RequestError as e:
        assert e.code == ErrorCode.INVALID_ARG and "control" in e.message or "name" in e.message \
            or "path" in e.message or "sha256" in e.message or "replace" in e.message or "op" in e.message, e.message
        return
    assert command["op"] in ("list_adapters", "stats", "model_info", "load_adapter", "unload_adapter")


# -- adapter names, request parameters ----------------------------------------------------

def test_adapter_names_are_taken_exactly_and_blank_ones_refused():
    assert parse_generation(good(lora_name=np.array([[b" shout"]], dtype=np.object_)), "r").adapter == " shout"
    for blank in (b" ", b"\t\n", "\u3000".encode()):
        refused(good(lora_name=np.array([[blank]], dtype=np.object_)), "lora_name is blank")


def with_parameters(parameters: dict, **overrides) -> GenerationRequest:
    return parse_generation(good(**overrides), "r", parameters=parameters)


def refused_parameters(parameters: dict, *words: str, **overrides) -> str:
    with pytest.raises(RequestError) as info:
        with_parameters(parameters, **overrides)
    assert info.value.code == ErrorCode.INVALID_ARG
    for word in words:
        assert word in info.value.message, info.value.message
    return info.value.message


def test_unknown_parameters_are_refused_by_name():
    refused_parameters({"lora_nme": "shout"}, "unknown parameter 'lora_nme'", "lora_name")
    refused_parameters({"exclude_input_in_output": False}, "exclude_input_in_output")
    # the server's own keys, and what the vLLM backend's clients send, are accepted
    assert with_parameters({"triton_enable_empty_final_response": True, "exclude_input_in_output": True}).adapter


def test_sampling_parameters_equal_the_same_values_as_tensors():
    alone = {"input_ids": np.array([[0, 4]], dtype=np.int32)}
    values = {"max_tokens": 9, "temperature": 0.5, "top_k": 7, "top_p": 0.8, "seed": 2**63, "stop": ["x", "yz"],
              "ignore_eos": True, "n": 1}
    from_json = parse_generation(alone, "r", parameters={"sampling_parameters": json.dumps(values)}).sampling
    tensors = parse_generation({**alone, "max_tokens": np.array([[9]], np.int32),
                                "temperature": np.array([[0.5]], np.float32), "top_k": np.array([[7]], np.int32),
                                "top_p": np.array([[0.8]], np.float64), "seed": np.array([[2**63]], np.uint64),
                                "stop": np.array([[b"x", b"yz"]], np.object_),
                                "ignore_eos": np.array([[True]])}, "r").sampling
    assert from_json == tensors and from_json.ignore_eos and from_json.stop == ("x", "yz")
    single = parse_generation(alone, "r", parameters={"sampling_parameters": '{"stop": "END"}'})
    assert single.sampling.stop == ("END",)


@pytest.mark.parametrize("values, words", [
    ({"presence_penalty": 1.0}, ["presence_penalty", "not supported"]),
    ({"n": 2}, ["n must be 1"]),
    ({"max_tokens": 2**40}, ["max_tokens must be in"]),
    ({"max_tokens": 4.5}, ["max_tokens must be an integer"]),
    ({"temperature": "hot"}, ["temperature"]),
    ({"stop": [1, 2]}, ["stop"]),
    ({"ignore_eos": 3}, ["ignore_eos"]),
    ({"top_p": None}, ["top_p"]),
])
def test_bad_sampling_parameters_are_refused(values, words):
    refused_parameters({"sampling_parameters": json.dumps(values)}, *words, max_tokens=None, stop=None, top_p=None,
                       temperature=None)


def test_sampling_parameters_must_be_a_json_object_and_not_repeat_an_input():
    for raw in ("{oops", "[1]", "3", "x" * 70_000):
        refused_parameters({"sampling_parameters": raw}, "sampling_parameters")
    refused_parameters({"sampling_parameters": 7}, "sampling_parameters")
    refused_parameters({"sampling_parameters": '{"max_tokens": 3}'}, "max_tokens is given twice")


def test_max_tokens_can_be_required():
    alone = {"input_ids": np.array([[0, 4]], dtype=np.int32)}
    with pytest.raises(RequestError, match="max_tokens is missing"):
        parse_generation(alone, "r", require_max_tokens=True)
    assert parse_generation(alone, "r", parameters={"sampling_parameters": '{"max_tokens": 5}'},
                            require_max_tokens=True).sampling.max_tokens == 5


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda children: st.lists(children, max_size=3)
                           | st.dictionaries(st.text(max_size=8), children, max_size=3), max_leaves=8)


@SETTINGS
@given(parameters=st.dictionaries(st.sampled_from(["sampling_parameters", "exclude_input_in_output", "triton_x",
                                                   "lora_nme", "temperature"]), JSON_VALUES, max_size=3),
       sampling=st.dictionaries(st.sampled_from(["max_tokens", "temperature", "top_k", "top_p", "seed", "stop",
                                                 "ignore_eos", "n", "min_p"]), JSON_VALUES, max_size=4))
def test_fuzz_request_parameters(parameters, sampling):
    if "sampling_parameters" in parameters and isinstance(parameters["sampling_parameters"], dict):
        parameters["sampling_parameters"] = json.dumps(sampling)
    try:
        req = parse_generation({"input_ids": np.array([[0, 4]], dtype=np.int32)}, "fuzz", parameters=parameters)
    except RequestError as e:
        assert e.code == ErrorCode.INVALID_ARG and e.message
        return
    s = req.sampling
    assert 1 <= s.max_tokens <= INT32_MAX and math.isfinite(s.temperature) and s.temperature >= 0
    assert 0 < s.top_p <= 1 and s.top_k >= 0 and isinstance(s.ignore_eos, bool)


def test_cancel_control():
    assert parse_control(control({"op": "cancel", "key": "k1"})) == {"op": "cancel", "key": "k1"}
    for bad in ({"op": "cancel"}, {"op": "cancel", "key": ""}, {"op": "cancel", "key": 5}):
        with pytest.raises(RequestError, match="cancel"):
            parse_control(control(bad))
