"""The OpenAI-compatible front (python -m manylora.openai) against the real server, through the official openai SDK.

Every generation is compared with the ``llm`` ensemble's own answer for the same prompt, adapter and sampling
(Triton's HTTP generate endpoint, greedy or seeded): the ensemble equals transformers + peft (test_e2e_oracle.py),
so the front adds nothing and loses nothing. Chat prompts are rendered by transformers' apply_chat_template as the
reference. One front process serves the whole session (conftest.openai_front); a second one, against the server
with runtime adapter updates on and a batch of 2, serves adapter management and the router metrics.
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from openai_front import start_front

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
BASE = "base"  # the embedded default's checkpoint directory name, which the front serves as the base model


def _sdk(front) -> openai.OpenAI:
    return openai.OpenAI(base_url=front.base_url, api_key="unused", max_retries=0, timeout=120)


def _llm(server, prompt: str, adapter: str | None, max_tokens: int = MAX_TOKENS, **extra) -> dict:
    """The llm ensemble's answer (Triton's HTTP generate): text_output, num_input_tokens, num_output_tokens,
    finish_reason."""
    body = {"text_input": prompt, "max_tokens": max_tokens, **extra}
    if adapter:
        body["lora_name"] = adapter
    status, text = server.post("/v2/models/llm/generate", body)
    assert status == 200, text
    return json.loads(text)


def _models(server) -> list[str | None]:
    return [None, *sorted(server.catalogue)]


def _name(adapter: str | None) -> str:
    return adapter or BASE


@pytest.fixture(scope="module")
def hf_tokenizer(server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(server.base_model))


# ------------------------------------------------------------------------------------------------- /v1/models
def test_models_lists_the_base_and_every_adapter(openai_front, client):
    sdk = _sdk(openai_front)
    models = {m.id: m for m in sdk.models.list()}
    adapters = {a["name"]: a for a in client.list_adapters() if a["status"] == "ready"}
    assert set(models) == {BASE, *adapters}
    for name, adapter in adapters.items():
        extra = models[name].model_extra
        assert extra["rank"] == adapter["rank"] and extra["sha256"] == adapter["sha256"], extra
        assert extra["parent"] == BASE
    assert models[BASE].model_extra["max_model_len"] == 256
    assert sdk.models.retrieve(f"{BASE}:pirate").model_extra["sha256"] == adapters["pirate"]["sha256"]
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("no-such-adapter")


# ------------------------------------------------------------------------------------- completions and chat
def _completion(sdk, model: str, prompt: str, stream: bool, **kwargs) -> tuple[str, str, dict]:
    """(text, finish_reason, usage) of one completion, streamed or not."""
    if not stream:
        out = sdk.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, **kwargs)
        assert out.model == model and len(out.choices) == 1
        return out.choices[0].text, out.choices[0].finish_reason, out.usage.model_dump(exclude_none=True)
    texts, reason, usage = [], None, None
    for chunk in sdk.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                        stream=True, stream_options={"include_usage": True}, **kwargs):
        assert chunk.model == model
        if chunk.choices:
            texts.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        if chunk.usage is not None:
            assert not chunk.choices  # the usage chunk comes last, alone
            usage = chunk.usage.model_dump(exclude_none=True)
    return "".join(texts), reason, usage


def _chat(sdk, model: str, messages: list[dict], stream: bool, **kwargs) -> tuple[str, str, dict]:
    if not stream:
        out = sdk.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                          **kwargs)
        assert out.choices[0].message.role == "assistant"
        return out.choices[0].message.content, out.choices[0].finish_reason, out.usage.model_dump(exclude_none=True)
    texts, reason, usage, roles = [], None, None, []
    for chunk in sdk.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                             stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.choices:
            delta = chunk.choices[0].delta
            roles += [delta.role] if delta.role else []
            texts.append(delta.content or "")
            reason = chunk.choices[0].finish_reason or reason
        if chunk.usage is not None:
            usage = chunk.usage.model_dump(exclude_none=True)
    assert roles == ["assistant"]
    return "".join(texts), reason, usage


def _usage(reference: dict) -> dict:
    n_in, n_out = reference["num_input_tokens"], reference["num_output_tokens"]
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_equal_the_llm_ensemble(openai_front, server, tokenizer, stream):
    """Base and every adapter at once (mixed batches): text, usage and finish_reason as the ensemble gives them."""
    sdk = _sdk(openai_front)
    prompt = "At the harbour the fishermen" if stream else "Behind the bakery a narrow lane"
    models = _models(server)
    with ThreadPoolExecutor(len(models)) as pool:
        got = dict(zip(models, pool.map(lambda a: _completion(sdk, _name(a), prompt, stream), models), strict=True))
    references = {a: _llm(server, prompt, a) for a in models}
    for adapter in models:
        text, reason, usage = got[adapter]
        reference = references[adapter]
        assert text == reference["text_output"], adapter
        assert reason == reference["finish_reason"] and reason in ("stop", "length"), adapter
        assert usage == _usage(reference), adapter
        assert usage["prompt_tokens"] == len(tokenizer.encode(prompt, add_special_tokens=True).ids)
        if reason == "length":
            assert usage["completion_tokens"] == MAX_TOKENS
    assert len({got[a][0] for a in models}) >= 4, got  # the adapters really change the output
    # model = <base>:<adapter> is the adapter
    assert _completion(sdk, f"{BASE}:shout", prompt, stream)[0] == got["shout"][0]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_renders_the_checkpoint_template_as_transformers_does(openai_front, server, hf_tokenizer, stream):
    sdk = _sdk(openai_front)
    messages = [{"role": "user", "content": "The ferry leaves at noon"},
                {"role": "assistant", "content": "and comes back"},
                {"role": "user", "content": "Tell me about the island" if stream else "Tell me about the market"}]
    rendered = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert isinstance(rendered, str) and rendered.startswith("<s>")
    prompt_ids = hf_tokenizer(rendered, add_special_tokens=False)["input_ids"]
    for adapter in (None, "pirate", "whisper"):
        text, reason, usage = _chat(sdk, _name(adapter), messages, stream)
        reference = _llm(server, rendered, adapter, add_special_tokens=False)
        assert text == reference["text_output"], adapter
        assert reason == reference["finish_reason"], adapter
        assert usage == _usage(reference) and usage["prompt_tokens"] == len(prompt_ids), adapter


def test_embedded_template_chat_of_one_message_is_its_completion(openai_front):
    """The embedded default's template: a one-message chat gets the tokens, so the reply, of that text's completion
    (what the quick start shows)."""
    sdk = _sdk(openai_front)
    text = "Every morning the postman"
    chat = _chat(sdk, "numbers", [{"role": "user", "content": text}], stream=False)
    assert chat == _completion(sdk, "numbers", text, stream=False)


def test_stop_seed_and_ignore_eos(openai_front, server):
    sdk = _sdk(openai_front)
    prompt = "The lighthouse keeper"
    full = _llm(server, prompt, "pirate", max_tokens=24,
                sampling_parameters=json.dumps({"ignore_eos": True}))["text_output"]
    words = [w for w in full.split() if len(w) > 2 and full.index(w) > 0]
    assert words, full
    stop = words[0]
    out = sdk.completions.create(model="pirate", prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "zzzq"],
                                 extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[:full.index(stop)]
    # ignore_eos: exactly max_tokens, finish_reason length
    out = sdk.completions.create(model="whisper", prompt=prompt, max_tokens=20, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 20
    # a seeded sampled request gives the ensemble's tokens for the same seed, whatever else runs
    kwargs = {"temperature": 0.9, "top_p": 0.95, "seed": 4242}
    first = sdk.completions.create(model="shout", prompt=prompt, max_tokens=MAX_TOKENS, **kwargs).choices[0].text
    reference = _llm(server, prompt, "shout", temperature=0.9, top_p=0.95, seed=4242)["text_output"]
    assert first == reference
    assert sdk.completions.create(model="shout", prompt=prompt, max_tokens=MAX_TOKENS, **kwargs).choices[0].text \
        == first


# --------------------------------------------------------------------------------------------------- errors
def test_unknown_model_is_404_naming_it(openai_front):
    sdk = _sdk(openai_front)
    for model in ("no-such-adapter", f"{BASE}:no-such-adapter"):
        with pytest.raises(openai.NotFoundError) as e:
            sdk.completions.create(model=model, prompt="Hello", max_tokens=4)
        assert model in e.value.message and e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="no-such-adapter", messages=[{"role": "user", "content": "Hi"}],
                                    max_tokens=4)
    with pytest.raises(openai.NotFoundError):  # streamed: refused before the stream starts
        sdk.completions.create(model="no-such-adapter", prompt="Hello", max_tokens=4, stream=True)


@pytest.mark.parametrize(("kwargs", "param", "words"), [
    ({"n": 2}, "n", "n must be 1"),
    ({"temperature": -0.5}, "temperature", "greater than or equal to 0"),
    ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
    ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"logprobs": 2}, "logprobs", "not supported"),
    ({"extra_body": {"lora_nme": "x"}}, "lora_nme", "unsupported parameter"),
    ({"max_tokens": 5000}, None, "exceeds the context of 256 tokens"),
])
def test_bad_values_are_400_naming_them(openai_front, kwargs, param, words):
    sdk = _sdk(openai_front)
    kwargs = {"max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model="shout", prompt="Hello there", **kwargs)
    assert words in e.value.message and e.value.param == param, e.value.message


def test_client_disconnect_cancels_the_request(openai_front, client):
    """A streamed and a whole request whose clients leave early: the engine stops them (fewer tokens generated than
    asked for) and is empty soon after."""
    asked = 240
    body = {"model": "shout", "prompt": "Hello", "max_tokens": asked, "ignore_eos": True}
    before = client.stats()["tokens_out"]
    with httpx.Client(base_url=openai_front.url, timeout=30) as http, \
            http.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        next(reply.iter_lines())  # the first event: the request runs; then the client leaves
    with pytest.raises(httpx.TimeoutException), httpx.Client(base_url=openai_front.url, timeout=0.1) as http:
        http.post("/v1/completions", json=body)
    deadline = time.monotonic() + 10
    while (stats := client.stats())["running"] or stats["waiting"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    assert stats["tokens_out"] - before < 2 * asked, stats


# -------------------------------------------------------------------------------- adapter management, routers
def test_adapter_management_needs_the_key_and_the_server_allowing_it(openai_front):
    body = {"lora_name": "extra", "lora_path": "/nonexistent"}
    with httpx.Client(base_url=openai_front.url, timeout=30) as http:
        assert http.post("/v1/load_lora_adapter", json=body).status_code == 401
        bad = http.post("/v1/load_lora_adapter", json=body, headers={"manylora-admin-key": "wrong"})
        assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
        # the right key, but this server runs without MANYLORA_ALLOW_RUNTIME_ADAPTERS: its refusal, as a 403
        refused = http.post("/v1/load_lora_adapter", json=body,
                            headers={"Authorization": f"Bearer {openai_front.admin_key}"})
        assert refused.status_code == 403 and "MANYLORA_ALLOW_RUNTIME_ADAPTERS" in refused.text, refused.text


@pytest.fixture(scope="module")
def admin_front(admin_server, tmp_path_factory):
    """A front against the admin server (runtime adapter updates on; 2 running + 4 waiting at most)."""
    front = start_front(admin_server.grpc_url, tmp_path_factory.mktemp("openai-admin"), "--stats-interval", "0")
    try:
        yield front
    finally:
        front.stop()


def test_load_serve_and_unload_an_adapter(admin_front, admin_server):
    sdk = _sdk(admin_front)
    headers = {"manylora-admin-key": admin_front.admin_key}
    name = "openai-loaded-pirate"
    prompt = "The baker's cat"
    with httpx.Client(base_url=admin_front.url, timeout=60) as http:
        loaded = http.post("/v1/load_lora_adapter", headers=headers,
                           json={"lora_name": name, "lora_path": admin_server.catalogue["pirate"]})
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["rank"] == 16
        try:
            assert name in {m.id for m in sdk.models.list()}
            got = sdk.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            assert got.choices[0].text == _llm(admin_server, prompt, "pirate")["text_output"]
        finally:
            unloaded = http.post("/v1/unload_lora_adapter", headers=headers, json={"lora_name": name})
        assert unloaded.status_code == 200, unloaded.text
        assert http.post("/v1/unload_lora_adapter", headers=headers, json={"lora_name": name}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        sdk.completions.create(model=name, prompt=prompt, max_tokens=4)


_LORA_INFO = re.compile(r'^vllm:lora_requests_info\{(?P<labels>[^}]*)\} (?P<value>\S+)$', re.M)


def _lora_info(text: str) -> tuple[dict[str, str], float]:
    match = _LORA_INFO.search(text)
    assert match, text
    labels = dict(re.findall(r'(\w+)="([^"]*)"', match["labels"]))
    return labels, float(match["value"])


def _gauge(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, (name, text)
    return float(match[1])


def test_router_metrics_follow_a_mixed_load(admin_front, admin_server):
    """The Gateway API inference extension's reading of /metrics: while 4 requests for 4 adapters run on a batch of 2
    (the server holds 4 waiting at most), the running and waiting adapter lists name them, max_lora is the server's,
    the value is the time."""
    sdk = _sdk(admin_front)
    idle, at = _lora_info(admin_front.metrics())
    assert abs(at - time.time()) < 60
    assert idle["max_lora"] == str(admin_server.client().stats()["max_loras"])
    jobs = ["shout", "pirate", "whisper", "numbers"]
    seen = {"running": set(), "waiting": set()}
    most = {"running": 0, "waiting": 0}
    done = threading.Event()

    def scrape() -> None:
        while not done.is_set():
            text = admin_front.metrics()
            labels, _ = _lora_info(text)
            for state in seen:
                seen[state] |= {a for a in labels[f"{state}_lora_adapters"].split(",") if a}
                most[state] = max(most[state], int(_gauge(text, f"vllm:num_requests_{state}")))
            time.sleep(0.02)

    watcher = threading.Thread(target=scrape, daemon=True)
    watcher.start()
    try:
        with ThreadPoolExecutor(len(jobs)) as pool:
            list(pool.map(lambda a: sdk.completions.create(model=_name(a), prompt="Hello", max_tokens=120,
                                                           extra_body={"ignore_eos": True}), jobs))
    finally:
        done.set()
        watcher.join(10)
    assert seen["running"] | seen["waiting"] == {"shout", "pirate", "whisper", "numbers"}, seen
    assert seen["waiting"], seen  # a batch of 2 leaves some waiting
    assert most["running"] == 2 and most["waiting"] >= 1, most
    after, _ = _lora_info(admin_front.metrics())
    assert after["running_lora_adapters"] == "" and after["waiting_lora_adapters"] == ""
    text = admin_front.metrics()
    assert 'manylora_openai_requests_total{route="/v1/completions",status="200"}' in text
