"""OpenAI request bodies -> the llm ensemble's inputs (protocol.py, translate.py, triton.py), and errors (errors.py):
what is accepted, what is refused by name, what reaches the server."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

pytest.importorskip("fastapi")
from tritonclient.grpc import service_pb2  # noqa: E402

from manylora.openai.chat_template import ChatTemplate  # noqa: E402
from manylora.openai.errors import OpenAIError, from_server  # noqa: E402
from manylora.openai.models import BaseModelInfo  # noqa: E402
from manylora.openai.protocol import ChatCompletionRequest, CompletionRequest, parse  # noqa: E402
from manylora.openai.translate import chat_generation, completion_generation, context_left  # noqa: E402
from manylora.openai.triton import llm_inputs, read_chunk  # noqa: E402

INFO = BaseModelInfo(name="base", max_model_len=256, chat_template=ChatTemplate(
    "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}", {"bos_token": "<s>"}))


def _completion(**body):
    return parse(CompletionRequest, json.dumps({"model": "base", "prompt": "Hello", **body}).encode())


def _chat(**body):
    messages = body.pop("messages", [{"role": "user", "content": "Hi"}])
    return parse(ChatCompletionRequest, json.dumps({"model": "m", "messages": messages, **body}).encode())


def _refused(call, *, status=400, param=None, words=""):
    with pytest.raises(OpenAIError) as e:
        call()
    assert e.value.status == status and e.value.param == param and words in e.value.message, e.value.message
    return e.value


def test_completion_fields_reach_the_generation():
    gen = completion_generation(_completion(max_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop=["\n", ""],
                                            stream=True, top_k=5, ignore_eos=True), "pirate", 16)
    assert (gen.prompt, gen.max_tokens, gen.adapter, gen.temperature, gen.top_p, gen.seed) == \
        ("Hello", 7, "pirate", 0.5, 0.9, 3)
    assert gen.stop == ("\n",) and gen.stream and gen.top_k == 5 and gen.ignore_eos and gen.add_special_tokens
    defaults = completion_generation(_completion(prompt=["Hi"], top_k=-1, stop="x"), None, 16)
    assert defaults.max_tokens == 16 and defaults.prompt == "Hi" and defaults.top_k is None
    assert defaults.stop == ("x",) and not defaults.stream and defaults.temperature is None


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"n": 2}, "n", "n must be 1"),
    ({"best_of": 3}, "best_of", "best_of must be 1"),
    ({"echo": True}, "echo", "echo is not supported"),
    ({"logprobs": 1}, "logprobs", "not supported"),
    ({"suffix": "x"}, "suffix", "not supported"),
    ({"presence_penalty": 0.1}, "presence_penalty", "only 0"),
    ({"frequency_penalty": -1}, "frequency_penalty", "only 0"),
    ({"repetition_penalty": 1.1}, "repetition_penalty", "only 1"),
    ({"logit_bias": {"1": 5}}, "logit_bias", "not supported"),
    ({"min_tokens": 2}, "min_tokens", "only 0"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options", "not supported"),
    ({"prompt": [1, 2, 3]}, "prompt", "token ids"),
    ({"prompt": ["a", "b"]}, "prompt", "several prompts"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"stop": [str(i) for i in range(17)]}, "stop", "at most 16"),
])
def test_completion_refusals_name_the_parameter(body, param, words):
    _refused(lambda: completion_generation(_completion(**body), None, 16), param=param, words=words)


@pytest.mark.parametrize(("raw", "param", "words"), [
    (b'{"model": "base", "prompt": "x", "lora_nme": "a"}', "lora_nme", "unsupported parameter 'lora_nme'"),
    (b'{"prompt": "x"}', "model", "'model' is required"),
    (b'{"model": "base", "prompt": "x", "max_tokens": 0}', "max_tokens", "greater than or equal to 1"),
    (b'{"model": "base", "prompt": "x", "temperature": -1}', "temperature", "greater than or equal to 0"),
    (b'{"model": "base", "prompt": "x", "top_p": 0}', "top_p", "greater than 0"),
    (b'{"model": "base", "prompt": "x", "seed": -1}', "seed", "greater than or equal to 0"),
    (b'{"model": "base", "prompt": "x", "max_tokens": "many"}', "max_tokens", "valid integer"),
    (b'{"model": "base", "prompt": "x",', None, "not valid JSON"),
    (b'[1, 2]', None, "JSON object"),
])
def test_protocol_refusals_name_the_field(raw, param, words):
    _refused(lambda: parse(CompletionRequest, raw), param=param, words=words)


def test_chat_renders_the_template_without_special_tokens_added():
    gen = chat_generation(_chat(messages=[{"role": "system", "content": "Be brief"},
                                          {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                                max_completion_tokens=9), "a1", INFO)
    assert gen.prompt == "<s>[system] Be brief\n[user] Hi\n[assistant]"
    assert not gen.add_special_tokens and gen.max_tokens == 9 and gen.adapter == "a1"
    # no max_tokens: the context left after the prompt, counted generously in bytes
    assert chat_generation(_chat(), None, INFO).max_tokens == context_left("<s>[user] Hi\n[assistant]", 256)
    assert chat_generation(_chat(add_generation_prompt=False), None, INFO).prompt == "<s>[user] Hi\n"


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format", "only text"),
    ({"logprobs": True}, "logprobs", "not supported"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens", "differ"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"content": "x"}]}, "messages", "required"),
])
def test_chat_refusals_name_the_parameter(body, param, words):
    _refused(lambda: chat_generation(_chat(**body), None, INFO), param=param, words=words)


def test_chat_without_a_template_says_what_to_do():
    e = _refused(lambda: chat_generation(_chat(), None, BaseModelInfo("m", 256, None)), param="messages",
                 words="has no chat template")
    assert e.code == "no_chat_template" and "--chat-template" in e.message


def test_context_left_is_at_least_one_and_needs_the_context():
    assert context_left("x" * 1000, 256) == 1
    _refused(lambda: context_left("x", None), param="max_tokens", words="max_tokens is required")


@pytest.mark.parametrize(("message", "status", "code"), [
    ("in ensemble 'llm', request r#1: unknown adapter 'zz'; registered: a, b", 404, "model_not_found"),
    ("adapter 'x' was refused at startup: rank 128 > max_lora_rank 64", 404, "model_not_found"),
    ("request r#2: queue full (4 waiting requests, max_queue_size); retry later", 503, "unavailable"),
    ("runtime adapter updates are off: set MANYLORA_ALLOW_RUNTIME_ADAPTERS=1", 403, "adapter_management_off"),
    ("prompt of 2 tokens + max_tokens 900 exceeds the context of 256 tokens (max_model_len)", 400, None),
    ("generator failed: boom", 500, None),
])
def test_server_errors_get_the_status_that_fits(message, status, code):
    e = from_server(message, model="zz")
    assert (e.status, e.code) == (status, code) and not e.message.startswith("in ensemble")
    body = e.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    if status == 404:
        assert "'zz'" in body["message"] and body["param"] == "model"


def test_llm_inputs_carry_every_field_with_the_batch_dimension():
    gen = completion_generation(_completion(max_tokens=5, temperature=0.7, top_p=0.8, top_k=3, seed=9,
                                            stop=["a", "bc"], ignore_eos=True, stream=True), "shout", 16)
    inputs, parameters = llm_inputs(gen)
    got = {t.name(): (t.datatype(), t.shape()) for t in inputs}
    assert got == {"text_input": ("BYTES", [1, 1]), "max_tokens": ("INT32", [1, 1]), "stream": ("BOOL", [1, 1]),
                   "lora_name": ("BYTES", [1, 1]), "temperature": ("FP32", [1, 1]), "top_p": ("FP32", [1, 1]),
                   "top_k": ("INT32", [1, 1]), "seed": ("UINT64", [1, 1]), "stop": ("BYTES", [1, 2])}
    assert json.loads(parameters["sampling_parameters"]) == {"ignore_eos": True}
    chat_inputs, none = llm_inputs(chat_generation(_chat(), None, INFO))
    names = {t.name() for t in chat_inputs}
    assert "add_special_tokens" in names and "lora_name" not in names and none is None


def _bytes(value: bytes) -> bytes:
    return struct.pack("<I", len(value)) + value


def test_read_chunk_from_the_raw_response():
    response = service_pb2.ModelInferResponse(model_name="llm")
    for name, datatype, raw in (("text_output", "BYTES", _bytes("Grüße 🙂".encode())),
                                ("num_input_tokens", "UINT32", np.array([11], np.uint32).tobytes()),
                                ("num_output_tokens", "UINT32", np.array([3], np.uint32).tobytes()),
                                ("finish_reason", "BYTES", _bytes(b"length")),
                                ("lora_version", "BYTES", _bytes(b"ab" * 32))):
        response.outputs.add(name=name, datatype=datatype, shape=[1, 1])
        response.raw_output_contents.append(raw)
    chunk = read_chunk(response)
    assert (chunk.text, chunk.input_tokens, chunk.output_tokens, chunk.finish_reason, chunk.lora_version) == \
        ("Grüße 🙂", 11, 3, "length", "ab" * 32)
    empty = read_chunk(service_pb2.ModelInferResponse(model_name="llm"))
    assert (empty.text, empty.output_tokens, empty.finish_reason) == ("", 0, "")


def test_grpc_failures_are_503_and_a_deadline_504():
    import grpc
    from grpc.aio import AioRpcError, Metadata

    from manylora.openai.triton import _unavailable

    def rpc_error(code):
        return AioRpcError(code, Metadata(), Metadata(), details="details here")

    late = _unavailable("h:1", rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED))
    assert late.status == 504 and late.code == "timeout"
    away = _unavailable("h:1", rpc_error(grpc.StatusCode.UNAVAILABLE))
    assert away.status == 503 and "h:1" in away.message and "details here" in away.message
