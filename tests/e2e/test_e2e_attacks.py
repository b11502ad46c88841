"""A hostile client against the real server: one attack at a time, each checked for its own outcome, and after each
the server must be ready, no Python-backend stub restarted, and a fixed set of greedy baselines (the base model and
every adapter, through the llm ensemble) byte-identical to what they were before any attack.

Classes: engine state (sampling values, prompts), abandoned requests, limits at the door, Triton's administrative
endpoints, silent fallbacks and statuses, counters. HTTP statuses: Triton 2.51's generate endpoints answer 400 for
every error a model sends (docs/security.md), so model-level refusals are checked by their messages.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from attack_tools import ADMIN, PROMPTS, Attack, Tools, as_ints, as_one, as_text, metric_sum, refused
from grpc_streams import grpc_input, stream_output_names

pytestmark = pytest.mark.e2e


# -------------------------------------------------------------------------------- engine state
def _tiny_temperature_is_greedy(s, t: Tools) -> str:
    body = {"text_input": PROMPTS[0], "max_tokens": 8, "temperature": 1e-45}
    with ThreadPoolExecutor(8) as pool:  # with other requests in flight, as the report had it
        others = [pool.submit(t.generate, {"text_input": p, "max_tokens": 8}) for p in PROMPTS * 3]
        status, text = t.generate(body)
        [f.result() for f in others]
    assert status == 200, text
    greedy = t.generate({"text_input": PROMPTS[0], "max_tokens": 8})[1]
    assert json.loads(text)["text_output"] == json.loads(greedy)["text_output"]
    return "served as greedy (temperature < 1e-5 is greedy)"


def _sampling_value(field: str, value, ok: bool, *words: str):
    def attack(s, t: Tools) -> str:
        status, text = t.generate({"text_input": PROMPTS[1], "max_tokens": 6, field: value, "seed": 7})
        if ok:
            assert status == 200, text
            return f"served ({field}={value})"
        return refused(t.error((status, text)), *words)
    return attack


def _grpc_float(field: str, value: float, *words: str):
    def attack(s, t: Tools) -> str:
        message = t.stream_error("generator", {"input_ids": as_ints(t.ids()), "max_tokens": as_one(4, np.int32),
                                               field: as_one(value, np.float32)})
        return refused(message, *words)
    return attack


def _generator_prompt(ids_of: Callable[[Tools], list[int]], *words: str):
    def attack(s, t: Tools) -> str:
        return refused(t.stream_error("generator", {"input_ids": as_ints(ids_of(t)),
                                                     "max_tokens": as_one(4, np.int32)}), *words)
    return attack


def _max_tokens(value: int, *words: str):
    def attack(s, t: Tools) -> str:
        return refused(t.error(t.generate({"text_input": PROMPTS[0], "max_tokens": value})), *words)
    return attack


# -------------------------------------------------------------------------------- abandoned requests
def _abandoned_streams(model: str, n: int):
    def attack(s, t: Tools) -> str:
        clients, before = [], t.counts()
        for i in range(n):
            grpc = grpcclient.InferenceServerClient(s.grpc_url)
            grpc.start_stream(callback=lambda result, error: None)
            if model == "llm":
                inputs = {"text_input": as_text(PROMPTS[i % 2]), "max_tokens": as_one(200, np.int32),
                          "stream": as_one(True, np.bool_)}
            else:
                inputs = {"input_ids": as_ints(t.ids()), "max_tokens": as_one(200, np.int32),
                          "stream": as_one(True, np.bool_), "ignore_eos": as_one(True, np.bool_)}
            grpc.async_stream_infer(model, [grpc_input(k, v) for k, v in inputs.items()],
                                    parameters={"sampling_parameters": json.dumps({"ignore_eos": True})}
                                    if model == "llm" else None)
            clients.append(grpc)
        deadline = time.monotonic() + 10
        while not t.in_flight() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert t.in_flight(), "the requests never started"
        for grpc in clients:
            grpc.stop_stream(cancel_requests=True)
        outcome = t.abandoned(before, n)
        for grpc in clients:
            grpc.close()
        return f"{n} streams cancelled: {outcome}"
    return attack


def _killed_client(s, t: Tools) -> str:
    code = (
        "import json, sys, time, numpy as np, tritonclient.grpc as g\n"
        f"c = g.InferenceServerClient({s.grpc_url!r}); c.start_stream(callback=lambda result, error: None)\n"
        "def t(n, a, d):\n"
        "    x = g.InferInput(n, list(a.shape), d); x.set_data_from_numpy(a); return x\n"
        "for i in range(8):\n"
        f"    c.async_stream_infer('llm', [t('text_input', np.array([[b'{PROMPTS[0]}']], np.object_), 'BYTES'),\n"
        "        t('max_tokens', np.array([[200]], np.int32), 'INT32'), t('stream', np.array([[True]]), 'BOOL')],\n"
        "        parameters={'sampling_parameters': json.dumps({'ignore_eos': True})})\n"
        "print('sent', flush=True); time.sleep(60)\n")
    before = t.counts()
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "sent"
        deadline = time.monotonic() + 10
        while not t.in_flight() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert t.in_flight()
    finally:
        child.kill()
        child.wait()
    return f"client killed mid-stream: {t.abandoned(before, 8)}"


def _closed_http_stream(s, t: Tools) -> str:
    body = json.dumps({"text_input": PROMPTS[0], "max_tokens": 200, "stream": True,
                       "sampling_parameters": json.dumps({"ignore_eos": True})})
    before = t.counts()
    curl = subprocess.Popen(["curl", "-s", "-N", "-H", "Content-Type: application/json",
                             f"http://{s.http_url}/v2/models/llm/generate_stream", "-d", body],
                            stdout=subprocess.PIPE)
    try:
        curl.stdout.readline()  # the first event: the request is generating
    finally:
        curl.kill()
        curl.wait()
    return f"HTTP stream closed: {t.abandoned(before, 1)}"


# -------------------------------------------------------------------------------- limits at the door
def _big_prompt(megabytes: int, over_grpc: bool):
    def attack(s, t: Tools) -> str:
        text = "the baker opens the shop " * (megabytes * (1 << 20) // 25)
        with ThreadPoolExecutor(4) as pool:
            if over_grpc:
                inputs = {"text_input": as_text(text), "max_tokens": as_one(4, np.int32)}
                big = pool.submit(t.stream_error, "llm", inputs)
            else:
                big = pool.submit(t.generate, {"text_input": text, "max_tokens": 4})
            time.sleep(0.05)
            started = time.monotonic()
            t.generate({"text_input": PROMPTS[1], "max_tokens": 4})
            other = time.monotonic() - started
            outcome = big.result()
        message = outcome if over_grpc else t.error(outcome)
        assert other < 2.0, f"another request waited {other:.1f} s behind the big prompt"
        return refused(message, "too long", "max_model_len") + f" (another request meanwhile: {other:.2f} s)"
    return attack


def _long_prompt_under_the_byte_bound(s, t: Tools) -> str:
    # enough text to be counted in pieces, too many tokens for the context, far fewer bytes than the bound
    text = " ".join(random.Random(1).choice(["baker", "river", "mill", "shop"]) for _ in range(20_000))
    return refused(t.error(t.generate({"text_input": text, "max_tokens": 4})), "too long")


def _text_input_value(value, *words: str):
    def attack(s, t: Tools) -> str:
        return refused(t.stream_error("llm", {"text_input": value, "max_tokens": as_one(4, np.int32)}), *words)
    return attack


def _stop_strings(array: np.ndarray, *words: str):
    def attack(s, t: Tools) -> str:
        return refused(t.stream_error("generator", {"input_ids": as_ints(t.ids()), "max_tokens": as_one(4, np.int32),
                                                     "stop": array}), *words)
    return attack


def _control(command: bytes, *words: str):
    def attack(s, t: Tools) -> str:
        return refused(t.stream_error("generator", {"control": as_text(command)}), *words)
    return attack


# -------------------------------------------------------------------------------- endpoints
def _shm_region(s) -> str:
    """One of the server's own Python-backend regions: what an attacker would map to read other clients' data."""
    regions = s.shm_regions()
    assert regions, f"no region named {s.shm_prefix}* in /dev/shm"
    return regions[0].name


def _register_backend_shm_http(s, t: Tools) -> str:
    status, text = t.http("/v2/systemsharedmemory/region/steal/register",
                          {"key": "/" + _shm_region(s), "offset": 0, "byte_size": 4096})
    assert status == 403 and ADMIN in text, (status, text)
    return "403: shared-memory API restricted"


def _register_backend_shm_grpc(s, t: Tools) -> str:
    grpc = grpcclient.InferenceServerClient(s.grpc_url)
    with pytest.raises(Exception) as refused:
        grpc.register_system_shared_memory("steal", "/" + _shm_region(s), 4096)
    assert "restricted" in str(refused.value)
    return "refused: gRPC shared-memory protocol restricted"


def _admin_http(path: str, method: str = "POST", body: dict | None = None):
    def attack(s, t: Tools) -> str:
        status, text = t.http(path, body if body is not None else ({} if method == "POST" else None), method=method)
        assert status == 403 and ADMIN in text, (status, text)
        opened = t.http(path, body if body is not None else ({} if method == "POST" else None), method=method,
                        headers={ADMIN: s.admin_key})[0]
        assert opened != 403, "the admin key does not open it"
        return f"403 without the key ({opened} with it)"
    return attack


def _listing_has_no_paths(s, t: Tools) -> str:
    adapters = t.client.list_adapters()
    assert adapters and all("path" not in a for a in adapters), adapters
    assert not any("/" in json.dumps(v) for a in adapters for v in a.values()), adapters
    stats = json.dumps(t.client.stats())
    assert str(s.base_model) not in stats
    return f"{len(adapters)} adapters listed, no server paths"


# -------------------------------------------------------------------------------- silent fallbacks
def _unknown_key(body: dict, *words: str):
    def attack(s, t: Tools) -> str:
        return refused(t.error(t.generate({"text_input": PROMPTS[0], "max_tokens": 4, **body})), *words)
    return attack


def _sampling_parameters_understood(s, t: Tools) -> str:
    tensors = t.generate({"text_input": PROMPTS[0], "max_tokens": 8, "temperature": 0.9, "seed": 11, "top_k": 20})
    json_form = t.generate({"text_input": PROMPTS[0], "max_tokens": 8,
                            "sampling_parameters": json.dumps({"temperature": 0.9, "seed": 11, "top_k": 20})})
    assert tensors[0] == json_form[0] == 200, (tensors, json_form)
    assert json.loads(tensors[1])["text_output"] == json.loads(json_form[1])["text_output"]
    return "served exactly as the same values given as inputs"


def _grpc_parameter(s, t: Tools) -> str:
    message = t.stream_error("llm", {"text_input": as_text(PROMPTS[0]), "max_tokens": as_one(4, np.int32)},
                             parameters={"lora_nme": "shout"})
    return refused(message, "unknown parameter", "lora_nme")


def _runtime_update_off(s, t: Tools) -> str:
    command = json.dumps({"op": "load_adapter", "name": "mine", "path": "/etc"}).encode()
    return refused(t.stream_error("generator", {"control": as_text(command)}), "runtime adapter updates are off")


def _forged_cancel(s, t: Tools) -> str:
    with ThreadPoolExecutor(4) as pool:
        runs = [pool.submit(t.generate, {"text_input": PROMPTS[0], "max_tokens": 30}) for _ in range(4)]
        for _ in range(20):
            key = "".join(random.choice("abcdefghijklmnopqrstuvwxyz0123456789_-") for _ in range(32))
            assert t.stream_error("generator", {"control": as_text(json.dumps({"op": "cancel", "key": key}))}) is None
        results = [f.result() for f in runs]
    assert all(status == 200 for status, _ in results) and len({text for _, text in results}) == 1
    return "20 guessed keys cancelled nothing"


def _cancel_answer_has_no_tensors(s, t: Tools) -> str:
    """postprocessing sends cancels through BLS, whose response tensors the 2.51 stub builds without the GIL."""
    cancel = {"control": as_text(json.dumps({"op": "cancel", "key": "k" * 32}))}
    assert stream_output_names(s, "generator", cancel, ["control_output"]) == []
    return "the final flag alone"


def _keepalive_without_its_key(s, t: Tools) -> str:
    """A direct generator request that sets keepalive (as preprocessing does) but asks for output_ids alone: its
    request_key, were it built, would be dropped by the stub without the GIL. The stub prunes what the client sees
    either way, so this checks the server through it; tests/test_stub_responses.py checks what the model builds."""
    inputs = {"input_ids": as_ints(t.ids()), "max_tokens": as_one(24, np.int32), "keepalive": as_one(True, np.bool_),
              "stream": as_one(True, np.bool_), "ignore_eos": as_one(True, np.bool_)}
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: stream_output_names(s, "generator", inputs, ["output_ids"]), range(16)))
    assert all(a and all(names == {"output_ids"} for names in a) for a in answers), answers[:2]
    return f"{sum(map(len, answers))} responses of output_ids alone"


def _postprocessing_one_output(s, t: Tools) -> str:
    """postprocessing called directly for one of its five outputs, from 8 streams at once: the stub would drop the
    other four without the GIL (while its other threads run Python) if they were built. The stub prunes what the
    client sees either way, so this checks the server through it; tests/test_stub_responses.py checks what the model
    builds."""
    ids = t.ids()
    step = {"request_key": as_text("k"), "output_ids": as_ints(ids[1:]), "context_ids": as_ints(ids[:1]),
            "strip_chars": as_ints([0]), "lora_version": as_text("")}
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: stream_output_names(s, "postprocessing", step, ["text_output"]),
                                range(64)))
    assert all(a == [{"text_output"}] for a in answers), answers[:3]
    return "64 answers of text_output alone"


def _bad_json(s, t: Tools) -> str:
    status, text = t.http("/v2/models/llm/generate", b'{"text_input": "hi", "max_tokens": ')
    assert status in (400, 500), (status, text)  # Triton's own parser answers (500 in 2.51)
    return f"{status} from Triton's parser"


def _wrong_type(s, t: Tools) -> str:
    status, text = t.generate({"text_input": PROMPTS[0], "max_tokens": "4"})
    assert status in (400, 500) and "error" in text, (status, text)
    return f"{status} from Triton's JSON conversion"


def _two_prompts(s, t: Tools) -> str:
    status, text = t.generate({"text_input": ["a", "b"], "max_tokens": 4})
    assert status == 400, (status, text)
    return "400 from Triton (batch size mismatch)"


ATTACKS = [
    # engine state: a hostile request must not touch the others
    Attack("temperature 1e-45 among other requests", "engine", _tiny_temperature_is_greedy),
    Attack("temperature 3e-38", "engine", _sampling_value("temperature", 3e-38, True)),
    Attack("temperature 3.4e38", "engine", _sampling_value("temperature", 3.4e38, True)),
    Attack("top_p 1e-45", "engine", _sampling_value("top_p", 1e-45, True)),
    Attack("top_k 2^31-1", "engine", _sampling_value("top_k", 2**31 - 1, True)),
    Attack("top_k -1", "engine", _sampling_value("top_k", -1, False, "top_k")),
    Attack("top_p 5", "engine", _sampling_value("top_p", 5, False, "top_p")),
    Attack("temperature -1", "engine", _sampling_value("temperature", -1, False, "temperature")),
    Attack("NaN temperature (gRPC)", "engine", _grpc_float("temperature", float("nan"), "temperature")),
    Attack("inf top_p (gRPC)", "engine", _grpc_float("top_p", float("inf"), "top_p")),
    Attack("token id past the vocabulary", "engine", _generator_prompt(lambda t: [0, 2**31 - 1], "vocabulary")),
    Attack("negative token id", "engine", _generator_prompt(lambda t: [0, -5], "vocabulary")),
    Attack("empty input_ids", "engine", _generator_prompt(lambda t: [], "empty prompt")),
    Attack("prompt as long as the context", "engine",
           _generator_prompt(lambda t: [0] + [5] * (t.server.max_model_len - 1), "context")),
    Attack("max_tokens 0", "engine", _max_tokens(0, "max_tokens")),
    Attack("max_tokens 2^31-1", "engine", _max_tokens(2**31 - 1, "max_tokens", "context")),
    # abandoned requests
    Attack("32 llm streams cancelled (gRPC)", "abandon", _abandoned_streams("llm", 32)),
    Attack("32 generator streams cancelled (gRPC)", "abandon", _abandoned_streams("generator", 32)),
    Attack("client killed mid-stream", "abandon", _killed_client),
    Attack("HTTP generate_stream closed", "abandon", _closed_http_stream),
    # limits at the door
    Attack("1 MB prompt over HTTP", "limits", _big_prompt(1, over_grpc=False)),
    Attack("20 MB prompt over gRPC", "limits", _big_prompt(20, over_grpc=True)),
    Attack("too many tokens under the byte bound", "limits", _long_prompt_under_the_byte_bound),
    Attack("invalid UTF-8 text_input", "limits", _text_input_value(as_text(b"\xff\xfe caf\xc3"), "UTF-8")),
    Attack("empty text_input", "limits", _text_input_value(as_text(b""), "empty")),
    Attack("500 stop strings", "limits", _stop_strings(np.array([[b"x"] * 500], np.object_), "stop")),
    Attack("a 10,000-character stop string", "limits", _stop_strings(as_text("y" * 10_000), "stop")),
    Attack("a 10,000-character lora_name", "limits", _unknown_key({"lora_name": "a" * 10_000}, "lora_name")),
    Attack("1 MB control request", "limits", _control(b"{" + b" " * (1 << 20) + b"}", "control")),
    Attack("control that is not JSON", "limits", _control(b"{not json", "control")),
    # Triton's administrative endpoints
    Attack("register the backend's shared memory (HTTP)", "endpoints", _register_backend_shm_http),
    Attack("register the backend's shared memory (gRPC)", "endpoints", _register_backend_shm_grpc),
    Attack("change log settings", "endpoints", _admin_http("/v2/logging", body={"log_verbose_level": 1})),
    Attack("change trace settings", "endpoints", _admin_http("/v2/trace/setting", body={"trace_rate": "1"})),
    Attack("list the model repository", "endpoints", _admin_http("/v2/repository/index")),
    Attack("read the generator's config", "endpoints", _admin_http("/v2/models/generator/config", "GET")),
    Attack("read per-model statistics", "endpoints", _admin_http("/v2/models/stats", "GET")),
    Attack("adapter listing and stats", "endpoints", _listing_has_no_paths),
    Attack("load an adapter from /etc", "endpoints", _runtime_update_off),
    Attack("forged cancel keys", "endpoints", _forged_cancel),
    Attack("a cancel asking for control_output", "endpoints", _cancel_answer_has_no_tensors),
    Attack("postprocessing asked for one output", "endpoints", _postprocessing_one_output),
    Attack("generator keepalive asking for output_ids alone", "endpoints", _keepalive_without_its_key),
    # silent fallbacks and statuses
    Attack("misspelled input lora_nme (HTTP)", "fallback", _unknown_key({"lora_nme": "shout"}, "lora_nme")),
    Attack("unknown parameter (gRPC)", "fallback", _grpc_parameter),
    Attack("sampling_parameters understood", "fallback", _sampling_parameters_understood),
    Attack("sampling_parameters with presence_penalty", "fallback",
           _unknown_key({"sampling_parameters": json.dumps({"presence_penalty": 1.0})}, "presence_penalty")),
    Attack("sampling_parameters not JSON", "fallback", _unknown_key({"sampling_parameters": "{oops"},
                                                                    "sampling_parameters")),
    Attack("sampling_parameters max_tokens 2^40", "fallback",
           lambda s, t: refused(t.error(t.generate({"text_input": PROMPTS[0], "sampling_parameters": json.dumps(
               {"max_tokens": 2**40})})), "max_tokens must be in")),
    Attack("max_tokens twice", "fallback", _unknown_key({"sampling_parameters": json.dumps({"max_tokens": 3})},
                                                        "given twice")),
    Attack("blank lora_name", "fallback", _unknown_key({"lora_name": "  "}, "blank")),
    Attack("unknown adapter", "fallback", _unknown_key({"lora_name": "no-such"}, "unknown adapter")),
    Attack("missing text_input", "fallback",
           lambda s, t: refused(t.error(t.generate({"max_tokens": 16, "lora_name": "x"})), "text_input")),
    Attack("missing max_tokens", "fallback",
           lambda s, t: refused(t.error(t.generate({"text_input": PROMPTS[0]})), "max_tokens")),
    Attack("truncated JSON body", "fallback", _bad_json),
    Attack("max_tokens as a string", "fallback", _wrong_type),
    Attack("two prompts in one request", "fallback", _two_prompts),
]


@pytest.fixture(scope="module")
def tools(server, tokenizer):
    return Tools(server, tokenizer)


@pytest.fixture(scope="module")
def baselines(server, tools):
    """Greedy text and adapter version of every (prompt, adapter) pair, before any attack."""
    return tools.baselines()


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.name for a in ATTACKS])
def test_attack_fails_alone_and_harms_no_one(attack, server, tools, baselines):
    stubs = tools.stub_pids()
    outcome = attack.run(server, tools)
    print(f"| {attack.kind} | {attack.name} | {outcome} |")
    assert server.ready(), f"server not ready after {attack.name}"
    assert tools.stub_pids() == stubs, f"a stub restarted after {attack.name}"
    tools.settles(within=5.0)
    assert tools.baselines() == baselines, f"baselines changed after {attack.name}"


def test_there_are_at_least_forty_attacks_in_every_class():
    kinds = {a.kind for a in ATTACKS}
    assert len(ATTACKS) >= 40 and kinds == {"engine", "abandon", "limits", "endpoints", "fallback"}


def test_one_count_of_errors_and_tokens(server, tools):
    """The engine's stats and the manylora metrics count the same failed requests and output tokens; Triton's own
    failure counter of the llm ensemble counts each failed llm request twice (its ensemble scheduler, 2.51)."""
    def snapshot():
        time.sleep(1.2)  # the metrics are flushed every 0.5 s
        metrics = server.metrics()
        stats = tools.client.stats()
        return (stats["errors"], stats["tokens_out"], metric_sum(metrics, "manylora_request_errors_total"),
                metric_sum(metrics, "manylora_output_tokens_total"),
                metric_sum(metrics, "nv_inference_request_failure", model="llm"))

    before = snapshot()
    failing = [{"lora_name": "nope"}, {"max_tokens": -1}, {"top_p": 5}, {"bogus": 1}, {"max_tokens": 4000},
               {"text_input": ""}, {"lora_name": " "}]
    for change in failing:
        assert tools.generate({"text_input": PROMPTS[0], "max_tokens": 4, **change})[0] == 400
    assert tools.stream_error("generator", {"input_ids": as_ints([0, 2**31 - 1]), "max_tokens": as_one(4, np.int32)})
    served = [json.loads(tools.generate({"text_input": p, "max_tokens": 9})[1]) for p in PROMPTS]
    after = snapshot()
    errors, tokens, metric_errors, metric_tokens, triton_llm = (a - b for a, b in zip(after, before, strict=True))
    assert errors == metric_errors == len(failing) + 1, (errors, metric_errors)
    assert triton_llm == 2 * len(failing), triton_llm
    expected_tokens = sum(len(tools.tokenizer.encode(r["text_output"], add_special_tokens=False).ids) for r in served)
    assert tokens == metric_tokens > 0, (tokens, metric_tokens)
    assert tokens <= 18 and abs(tokens - expected_tokens) <= 2, (tokens, expected_tokens)
