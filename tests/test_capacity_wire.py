"""perf/capacity/wire.py: the requests a capacity run sends and what each response counts, on fresh random inputs
built as the real protobuf messages tritonclient's gRPC service defines."""

from __future__ import annotations

import random
import re
import struct
from pathlib import Path

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from perf.capacity.wire import (
    LLM_OUTPUTS,
    RunSpec,
    SendSpec,
    build_request,
    bytes_element,
    count_response,
    prompt_text,
    text_of_bytes_tensor,
)

REPO = Path(__file__).resolve().parents[1]


def _response(outputs: dict[str, bytes]) -> object:
    """A ModelInferResponse whose outputs (in the given order) carry these serialized contents."""
    response = pb.ModelInferResponse(model_name="m", id="r")
    for name, raw in outputs.items():
        response.outputs.add().name = name
        response.raw_output_contents.append(raw)
    return response


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdé漢 \n") for _ in range(rng.randrange(0, 12)))


def test_build_request_has_the_batch_dimension():
    spec = SendSpec(slot=3, offset_s=0.5, prompt_ids=(5, 6, 7), output_len=9, adapter="lora-0002")
    request = build_request(pb, "c1-3", spec, RunSpec("generator", True, True, False, [spec]))
    shapes = {t.name: (t.datatype, list(t.shape)) for t in request.inputs}
    assert shapes == {"input_ids": ("INT32", [1, 3]), "max_tokens": ("INT32", [1, 1]), "stream": ("BOOL", [1, 1]),
                      "ignore_eos": ("BOOL", [1, 1]), "lora_name": ("BYTES", [1, 1])}
    raw = dict(zip([t.name for t in request.inputs], request.raw_input_contents, strict=True))
    assert np.frombuffer(raw["input_ids"], "<i4").tolist() == [5, 6, 7]
    assert text_of_bytes_tensor(raw["lora_name"]) == "lora-0002" and raw["ignore_eos"] == b"\x01"
    assert request.parameters["triton_enable_empty_final_response"].bool_param and request.id == "c1-3"
    assert [o.name for o in request.outputs] == ["output_ids"]
    base = build_request(pb, "x", SendSpec(0, 0, (5,), 2, None), RunSpec("llm", False, False, False, []))
    assert {t.name for t in base.inputs} == {"text_input", "max_tokens", "stream"}
    assert "sampling_parameters" not in base.parameters


def test_an_llm_request_asks_for_what_the_openai_front_asks_for():
    """The ensemble's outputs, all of them, as manylora.openai requests them: an llm run costs the server what a
    user's stream costs. ignore_eos goes in the sampling parameters (the ensemble has no such input)."""
    from manylora.openai.triton import OUTPUTS

    spec = SendSpec(0, 0.0, (9, 10), 4, "a")
    request = build_request(pb, "x", spec, RunSpec("llm", True, True, False, [spec]))
    asked = [o.name for o in request.outputs]
    config = (REPO / "model_repository" / "llm" / "config.pbtxt").read_text()
    declared = re.findall(r'\{ name: "(\w+)"', config[config.index("output ["):config.index("ensemble_scheduling")])
    assert asked[0] == "text_output" and set(asked) == set(LLM_OUTPUTS) == set(OUTPUTS) == set(declared)
    assert request.parameters["sampling_parameters"].string_param == '{"ignore_eos": true}'
    assert {t.name for t in request.inputs} == {"text_input", "max_tokens", "stream", "lora_name"}


def test_a_generator_response_counts_its_ids():
    rng = random.Random()
    for _ in range(20):
        ids = [rng.randrange(0, 2**31) for _ in range(rng.randrange(1, 40))]
        count = count_response(_response({"output_ids": np.asarray(ids, dtype="<i4").tobytes()}), text=False)
        assert (count.tokens, count.ids, count.chars) == (len(ids), ids, 0)
    empty = count_response(_response({}), text=False)  # the empty final response
    assert (empty.tokens, empty.ids, empty.chars) == (0, [], 0)


def test_an_llm_response_counts_the_tokens_it_accounts_for_not_its_words():
    """num_output_tokens, whatever the text holds: a special token decodes to nothing, a chunk may end inside a
    word. The outputs come in any order."""
    rng = random.Random()
    for _ in range(30):
        tokens, text = rng.randrange(0, 500), _word(rng)
        outputs = {"text_output": bytes_element(text), "num_output_tokens": struct.pack("<I", tokens),
                   "num_input_tokens": struct.pack("<I", rng.randrange(1, 600)),
                   "finish_reason": bytes_element(rng.choice(["", "stop", "length"])),
                   "lora_version": bytes_element(_word(rng))}
        order = list(outputs)
        rng.shuffle(order)
        count = count_response(_response({name: outputs[name] for name in order}), text=True)
        assert (count.tokens, count.ids, count.chars) == (tokens, [], len(text))
    empty = count_response(_response({}), text=True)
    assert (empty.tokens, empty.chars) == (0, 0)


def test_text_of_a_bytes_tensor_round_trips():
    rng = random.Random()
    for _ in range(20):
        text = _word(rng)
        assert text_of_bytes_tensor(bytes_element(text)) == text
    assert text_of_bytes_tensor(b"\x01") == ""


def test_prompt_text_round_trips_through_the_checkpoint_tokenizer(tmp_path):
    from tokenizers import Tokenizer

    from perf.engine.checkpoint import write_tokenizer

    rng = random.Random()
    write_tokenizer(tmp_path, 512)
    ids = tuple(rng.randrange(4, 512) for _ in range(rng.randrange(1, 100)))
    assert tuple(Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(prompt_text(ids)).ids) == ids
