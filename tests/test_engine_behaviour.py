"""Engine behaviour beyond greedy equality: streaming text, stops, errors, cancellation."""

from __future__ import annotations

import random
import threading
import time

import pytest

from manylora.engine.config import EngineConfig
from manylora.engine.errors import ErrorCode, RequestError
from manylora.engine.requests.detokenize import IncrementalDecoder, decode_chunk
from manylora.engine.requests.sampling import make_generator
from manylora.engine.requests.types import GenerationRequest, SamplingParams
from manylora.engine.scheduling.engine import Engine
from manylora.engine.scheduling.offline import generate
from manylora.engine.scheduling.sequence import Sequence
from model_factory import make_adapter, make_base


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("behaviour")
    base = make_base(root / "base", "llama", seed=21)
    adapter = make_adapter(base, root / "a", rank=4, targets=["q_proj", "v_proj"], seed=3)
    eng = Engine(EngineConfig(model_dir=str(base), adapters={"a": str(adapter)}, max_model_len=64))
    yield eng
    eng.shutdown()


def _sampled(n: int, seed: int, **kw) -> list[GenerationRequest]:
    rng = random.Random(seed)
    return [GenerationRequest(f"s{seed}-{i}", [0] + [rng.randrange(2, 290) for _ in range(rng.randint(1, 8))],
                              rng.choice([None, "a"]),
                              SamplingParams(max_tokens=30, temperature=1.3, seed=rng.randrange(1 << 30), **kw))
            for i in range(n)]


def test_streamed_text_equals_whole_text_when_sampling_bytes(engine):
    """High-temperature sampling emits byte tokens, valid UTF-8 or not; chunks still add up."""
    tok = engine.tokenizer
    for seed in range(3):
        for c in generate(engine, _sampled(8, seed)):
            # a boundary that split a character would turn it into replacement characters here
            assert c.text(tok) == tok.decode(c.token_ids, skip_special_tokens=True)


def test_chunks_never_split_a_character(engine):
    """Feed single-byte tokens of multi-byte text: every released chunk decodes to whole characters."""
    tok = engine.tokenizer
    text = "café 東京 naïve 🙂!"
    alphabet = {ch: tok.token_to_id(ch) for ch in _byte_level_alphabet(text.encode())}
    byte_ids = [alphabet[ch] for ch in _byte_level_alphabet(text.encode())]
    assert None not in byte_ids
    seq = Sequence(GenerationRequest("bytes", [0, 5], None, SamplingParams(max_tokens=len(byte_ids) + 1)),
                   emit=lambda out: None, decoder=IncrementalDecoder(tok), generator=make_generator(0),
                   eos_ids=frozenset(), max_len=1000, spec=None)
    texts = []
    for token in byte_ids:
        seq.append_token(token)
        out = seq.next_output()
        if out is not None:
            piece = decode_chunk(tok, out.token_ids, out.context_ids, out.strip_chars)
            assert "\ufffd" not in piece
            texts.append(piece)
    assert "".join(texts) == text
    assert len(texts) == len(text), "each character should be released as soon as it is whole"


def _byte_level_alphabet(data: bytes) -> list[str]:
    """The ByteLevel pre-tokenizer's printable stand-in for each byte (GPT-2's table)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in data]


def test_stop_strings_cut_the_text_in_stream_and_whole(engine):
    tok = engine.tokenizer
    reqs = _sampled(6, 42)
    free = generate(engine, reqs)
    for req, res in zip(reqs, free, strict=True):
        text = res.text(tok)
        if len(text) < 6:
            continue
        stop = text[3:5]  # a stop string that may end inside a token
        expected = text[: text.find(stop)]
        for stream in (True, False):
            again = GenerationRequest(req.request_id + f"-stop{stream}", req.prompt_ids, req.adapter,
                                      SamplingParams(max_tokens=30, temperature=1.3, seed=req.sampling.seed,
                                                     stop=(stop, "never-appears")), stream=stream)
            res2 = generate(engine, [again])[0]
            assert res2.finish_reason == "stop"
            assert res2.text(tok) == expected


@pytest.mark.parametrize("change, message", [
    ({"prompt_ids": []}, "empty prompt"),
    ({"prompt_ids": [0] * 64}, "does not fit the context of 64"),
    ({"max_tokens": 0}, "max_tokens must be > 0"),
    ({"max_tokens": 1000}, "exceeds the context"),
    ({"temperature": -1.0}, "temperature must be >= 0"),
    ({"temperature": float("nan")}, "temperature must be >= 0"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"top_k": -2}, "top_k must be >= 0"),
    ({"adapter": "nope"}, "unknown adapter 'nope'; registered: a"),
    ({"prompt_ids": [0, 99999]}, "outside the vocabulary"),
])
def test_bad_requests_are_refused_alone(engine, change, message):
    good = _sampled(4, 7)
    prompt = change.get("prompt_ids", [0, 5, 6])
    params = {k: v for k, v in change.items() if k in ("max_tokens", "temperature", "top_p", "top_k")}
    bad = GenerationRequest("bad", prompt, change.get("adapter"), SamplingParams(**{"max_tokens": 5, **params}))
    results = generate(engine, [*good[:2], bad, *good[2:]])
    assert isinstance(results[2].error, RequestError)
    assert message in results[2].error.message
    assert "bad" in results[2].error.message
    expected_code = ErrorCode.NOT_FOUND if "adapter" in change else ErrorCode.INVALID_ARG
    assert results[2].error.code is expected_code
    for r in results[:2] + results[3:]:
        assert r.error is None and r.finish_reason in ("length", "eos") and r.token_ids


def test_cancellation_frees_the_request(engine, monkeypatch):
    import manylora.engine.scheduling.engine

    monkeypatch.setattr(manylora.engine.scheduling.engine, "CANCEL_POLL_S", 0.0)  # poll every loop: the model is fast
    cancelled = threading.Event()
    outputs = []
    done = threading.Event()

    def emit(out):
        outputs.append(out)
        cancelled.set()  # after the first chunk (chunks are stream_interval_ms apart: few in 60 tokens)
        if out.finished:
            done.set()

    req = GenerationRequest("c", [0, 5, 6], None, SamplingParams(max_tokens=60, ignore_eos=True),
                            is_cancelled=cancelled.is_set)
    engine.submit(req, emit)
    assert done.wait(30)
    last = outputs[-1]
    assert last.error is not None and last.error.code is ErrorCode.CANCELLED
    assert len([t for o in outputs for t in o.token_ids]) < 60
    deadline = time.time() + 5
    while engine.stats()["running"] and time.time() < deadline:
        time.sleep(0.01)
    assert engine.pool.usage()["kv"] == 0


def test_emit_failure_does_not_stop_the_engine(engine):
    def broken(out):
        raise RuntimeError("client went away")

    engine.submit(GenerationRequest("broken", [0, 5, 6], None, SamplingParams(max_tokens=5)), broken)
    after = generate(engine, _sampled(3, 99))
    assert all(r.error is None for r in after)


def test_a_finished_request_has_freed_its_pages_when_its_client_hears_it(engine):
    """The last output of a request (streamed or not) comes after its KV pages went back to the pool: a client
    that reads the pool, or submits again, on hearing "finished" sees them free."""
    seen: dict[str, int] = {}
    done = threading.Event()
    requests = [GenerationRequest(f"f{i}", [0, 7, 9, 11], None, SamplingParams(max_tokens=4, ignore_eos=True),
                                  stream=stream) for i, stream in enumerate((True, False))]

    def emitter(rid):
        def emit(out):
            if out.finished:
                seen[rid] = engine.pool.usage()["kv"]
                if len(seen) == len(requests):
                    done.set()
        return emit

    for r in requests:
        engine.submit(r, emitter(r.request_id))
    assert done.wait(30)
    # KV pages still held when the callback ran can only be the other request's (both run in one batch)
    assert min(seen.values()) == 0 and max(seen.values()) <= engine.kv.pages_needed(4 + 4), seen


def test_an_undeliverable_last_output_counts_as_an_error(engine):
    """A request whose only output (not streamed) cannot be delivered is counted failed, not finished."""
    def broken(out):
        raise RuntimeError("client went away")

    before = engine.stats()
    engine.submit(GenerationRequest("gone", [0, 5, 6], None, SamplingParams(max_tokens=3), stream=False), broken)
    deadline = time.time() + 30
    while engine.stats()["errors"] == before["errors"] and time.time() < deadline:
        time.sleep(0.01)
    after = engine.stats()
    assert after["errors"] == before["errors"] + 1 and after["finished"] == before["finished"]
    assert engine.pool.usage()["kv"] == 0


def test_queue_limit_refuses_with_unavailable(tmp_path):
    base = make_base(tmp_path / "base", "llama", layers=1, seed=2)
    eng = Engine(EngineConfig(model_dir=str(base), max_queue_size=2), start=False)
    try:
        for i in range(2):
            eng.submit(GenerationRequest(f"q{i}", [0, 4], None, SamplingParams(max_tokens=2)), lambda out: None)
        with pytest.raises(RequestError) as err:
            eng.submit(GenerationRequest("q2", [0, 4], None, SamplingParams(max_tokens=2)), lambda out: None)
        assert err.value.code is ErrorCode.UNAVAILABLE and "max_queue_size" in err.value.message
    finally:
        eng.shutdown()


def test_instance_device_follows_triton_placement():
    """A KIND_GPU instance's engine runs on the GPU Triton placed it on, unless the device is set."""
    from manylora.engine.devices import instance_device

    assert instance_device("auto", "GPU", "2") == "cuda:2"
    assert instance_device("", "GPU", 0) == "cuda:0"
    assert instance_device("cuda:1", "GPU", "3") == "cuda:1"  # an explicit parameter wins
    assert instance_device("cpu", "GPU", "3") == "cpu"
    assert instance_device("auto", "MODEL", "0") == "auto"  # KIND_MODEL: the engine decides
    assert instance_device("auto", "CPU", None) == "auto"


def test_decode_form_names_are_checked():
    """An unknown decode LoRA form is refused when the configuration is made, naming the knob and the choices."""
    with pytest.raises(ValueError, match="decode_lora_kernels must be one of bgmv, sgmv, hybrid"):
        EngineConfig(model_dir=".", decode_lora_kernels="grouped")


def test_base_gemm_knob_is_checked_and_read_from_config_strings():
    with pytest.raises(ValueError, match=r"base_gemm must be one of \('torch', 'triton', 'auto'\), got 'cublas'"):
        EngineConfig(model_dir=".", base_gemm="cublas")
    assert EngineConfig.from_strings({"model_dir": ".", "base_gemm": "triton"}).base_gemm == "triton"
    assert EngineConfig.from_strings({"model_dir": ".", "base_gemm": "auto"}).base_gemm == "auto"
    assert EngineConfig(model_dir=".").base_gemm == "torch"


def test_model_kernel_options_carry_every_knob_the_model_reads():
    """The options the engine applies to its model (and hands to tensor-parallel ranks) are EngineConfig's knobs of
    the same names, with the kernels resolved: a knob added to one but not the other would be dropped silently."""
    import dataclasses

    from manylora.engine.config import ModelKernelOptions
    from manylora.engine.models.llama import LlamaModel

    config = EngineConfig(model_dir=".", fuse_add_norm=False, fuse_rope_kv=False, base_gemm="triton")
    options = ModelKernelOptions.of(config, use_kernels=True)
    assert options == ModelKernelOptions(use_kernels=True, fuse_add_norm=False, fuse_silu_mul=True,
                                         fuse_rope_kv=False, base_gemm="triton")
    model = LlamaModel.__new__(LlamaModel)
    options.apply_to(model)
    for f in dataclasses.fields(options):
        assert getattr(model, f.name) == getattr(options, f.name)
        assert hasattr(LlamaModel, f.name), f"LlamaModel has no class default for {f.name}"
