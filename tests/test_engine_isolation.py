"""Isolation as an invariant: whatever one request sends, every other request's output is exactly what it would be
alone, and the engine's state stays consistent.

A fuzz test drives the engine with random mixes of innocent requests (greedy and seeded sampling, base and adapters,
streamed or not, stop strings) and hostile ones (near-zero and huge temperatures, extreme top-k / top-p, bad prompts,
unknown adapters, clients that cancel, clients whose callback raises, a request whose forward raises, a request whose
sampling raises), all in flight together, then runs every innocent request alone and compares. Rounds go on for
MANYLORA_FUZZ_SECONDS (default 40); the seed (MANYLORA_FUZZ_SEED, default random) is printed on failure.

The one difference allowed is arithmetic, not isolation: a row's logits move by a few 1e-7 with the batch it is
computed in, so a greedy request whose two best logits tie (the transformers + PEFT oracle puts them within TIE) may
take either. From such a token on, its output must be what it gives alone after the token it took.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field, replace

import pytest
import torch

import manylora.engine.scheduling.engine
from manylora.engine.config import EngineConfig
from manylora.engine.errors import ErrorCode, RequestError
from manylora.engine.requests.sampling import is_greedy
from manylora.engine.requests.types import GenerationOutput, GenerationRequest, SamplingParams
from manylora.engine.scheduling.engine import Engine
from manylora.engine.scheduling.offline import generate
from model_factory import make_adapter, make_base

POISON_FORWARD = 3  # a prompt with this token id at position POISON_AT makes the model's forward raise
POISON_AT = 3  # every prompt is longer than this, so no generated token sits there
POISON_SEED = 666_666  # a request with this seed makes sampling raise
VOCAB = 300
MAX_LEN = 64
FUZZ_SECONDS = float(os.environ.get("MANYLORA_FUZZ_SECONDS", "40"))
BASE_SEED = int(os.environ.get("MANYLORA_FUZZ_SEED", str(random.SystemRandom().randrange(2**32))))
TIE = 1e-5  # two logits the oracle puts closer than this tie: batch arithmetic may order them either way


class TieOracle:
    """transformers + PEFT logits (float32, CPU) for the fixture's base and adapters, loaded when first asked."""

    def __init__(self, base: str, adapters: dict[str, str]):
        self.base, self.adapters, self.models = base, adapters, {}

    def model(self, adapter: str | None):
        if adapter not in self.models:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(self.base, dtype=torch.float32)
            if adapter is not None:
                from peft import PeftModel

                model = PeftModel.from_pretrained(model, self.adapters[adapter])
            self.models[adapter] = model.eval()
        return self.models[adapter]

    def tie(self, adapter: str | None, context: list[int], x: int, y: int) -> bool:
        """Whether tokens x and y both sit within TIE of the best next-token logit after context."""
        with torch.no_grad():
            logits = self.model(adapter)(torch.tensor([context])).logits[0, -1]
        best = logits.max()
        return bool(best - logits[x] <= TIE and best - logits[y] <= TIE)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("isolation")
    base = make_base(root / "base", "llama", seed=5)
    adapters = {"a": str(make_adapter(base, root / "a", rank=4, targets=["q_proj", "v_proj"], seed=1)),
                "b": str(make_adapter(base, root / "b", rank=8, targets=["o_proj", "down_proj"], seed=2))}
    # few sequences and few pages: requests queue, and running ones are preempted and recomputed
    eng = Engine(EngineConfig(model_dir=str(base), adapters=adapters, max_model_len=MAX_LEN, max_num_seqs=6,
                              num_kv_pages=14, page_size=8, max_loras=2))
    yield eng, TieOracle(str(base), adapters)
    eng.shutdown()


@pytest.fixture(scope="module")
def engine(setup):
    return setup[0]


@pytest.fixture(scope="module")
def oracle(setup):
    return setup[1]


@pytest.fixture(autouse=True)
def _faults(engine, monkeypatch):
    """The two injected faults: a forward over a batch holding POISON_FORWARD raises; sampling for POISON_SEED
    raises. Innocent requests never hold either."""
    forward = engine.model.forward

    def poisoned_forward(batch, kv, lora):
        if ((batch.positions == POISON_AT) & (batch.input_ids == POISON_FORWARD)).any():
            raise RuntimeError("injected forward fault")
        return forward(batch, kv, lora)

    sample = manylora.engine.scheduling.engine.sample_next

    def poisoned_sample(logits, params, generator):
        if params.seed == POISON_SEED:
            raise RuntimeError("injected sampling fault")
        return sample(logits, params, generator)

    monkeypatch.setattr(engine.model, "forward", poisoned_forward)
    monkeypatch.setattr(manylora.engine.scheduling.engine, "sample_next", poisoned_sample)
    monkeypatch.setattr(manylora.engine.scheduling.engine, "CANCEL_POLL_S", 0.01)


@dataclass
class Outcome:
    outputs: list[GenerationOutput] = field(default_factory=list)
    refused: RequestError | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def tokens(self) -> list[int]:
        return [t for o in self.outputs for t in o.token_ids]

    @property
    def last(self) -> GenerationOutput | None:
        finals = [o for o in self.outputs if o.finished]
        return finals[-1] if finals else None


def _prompt(rng: random.Random, n: int | None = None) -> list[int]:
    n = n if n is not None else rng.randint(POISON_AT + 1, 20)
    return [0] + [rng.randrange(4, VOCAB) for _ in range(n - 1)]


def _innocent(rng: random.Random, rid: str) -> GenerationRequest:
    if rng.random() < 0.5:
        params = SamplingParams(max_tokens=rng.randint(1, 24))
    else:
        params = SamplingParams(max_tokens=rng.randint(1, 24), temperature=rng.uniform(0.6, 1.6),
                                top_k=rng.choice([0, 5, 50]), top_p=rng.choice([1.0, 0.9, 0.5]),
                                seed=rng.randrange(1, 2**40))
    if rng.random() < 0.2:
        params = replace(params, stop=(rng.choice(["e", "th", " the", "o"]),))
    return GenerationRequest(rid, _prompt(rng), rng.choice([None, "a", "b"]), params, stream=rng.random() < 0.7)


def _hostile(rng: random.Random, rid: str) -> tuple[GenerationRequest, str]:
    """A hostile request and what it does: "greedy" (must equal its greedy twin), "refused", "fails", "cancel",
    "cancel_call", "raise_emit", "any" (any outcome, others unharmed)."""
    kind = rng.choice(["tiny_temp", "huge_temp", "tiny_top_p", "huge_top_k", "bad_token", "empty", "too_long",
                       "unknown_adapter", "poison_forward", "poison_sample", "cancel", "cancel_call", "raise_emit"])
    prompt, adapter = _prompt(rng), rng.choice([None, "a", "b"])
    params = SamplingParams(max_tokens=rng.randint(1, 24))
    if kind == "tiny_temp":
        temp = rng.choice([1e-45, 1e-40, 3e-38, 1e-30, 1e-10, 9.99e-6])
        return GenerationRequest(rid, prompt, adapter, replace(params, temperature=temp, seed=rng.randrange(9)),
                                 stream=rng.random() < 0.5), "greedy"
    if kind == "huge_temp":
        return GenerationRequest(rid, prompt, adapter, replace(params, temperature=rng.choice([1e30, 3.4e38]),
                                                                seed=rng.randrange(9))), "any"
    if kind == "tiny_top_p":
        return GenerationRequest(rid, prompt, adapter, replace(params, temperature=1.0, top_p=1e-45, seed=1)), "any"
    if kind == "huge_top_k":
        return GenerationRequest(rid, prompt, adapter, replace(params, temperature=1.0, top_k=2**31 - 1, seed=1)), "any"
    if kind == "bad_token":
        return GenerationRequest(rid, prompt + [rng.choice([VOCAB, 2**31 - 1, -1])], adapter, params), "refused"
    if kind == "empty":
        return GenerationRequest(rid, [], adapter, params), "refused"
    if kind == "too_long":
        return GenerationRequest(rid, _prompt(rng, MAX_LEN), adapter, params), "refused"
    if kind == "unknown_adapter":
        return GenerationRequest(rid, prompt, rng.choice(["c", "a ", "../a"]), params), "refused"
    if kind == "poison_forward":
        prompt[POISON_AT] = POISON_FORWARD
        return GenerationRequest(rid, prompt, adapter, params), "fails"
    if kind == "poison_sample":
        return GenerationRequest(rid, prompt, adapter, replace(params, temperature=1.0, seed=POISON_SEED)), "fails"
    return GenerationRequest(rid, prompt, adapter, replace(params, max_tokens=rng.randint(10, 40))), kind


def _run_mix(engine: Engine, rng: random.Random, requests: list[tuple[GenerationRequest, str]]) -> dict[str, Outcome]:
    outcomes = {r.request_id: Outcome() for r, _ in requests}

    def emitter(rid: str, kind: str):
        def emit(out: GenerationOutput) -> None:
            if kind == "raise_emit" and not out.heartbeat:
                outcomes[rid].done.set()
                raise RuntimeError("client callback fails")
            outcomes[rid].outputs.append(out)
            if out.finished:
                outcomes[rid].done.set()
        return emit

    for request, kind in requests:
        if kind == "cancel":
            flag = threading.Event()
            threading.Timer(rng.uniform(0.0, 0.05), flag.set).start()
            request.is_cancelled = flag.is_set
        try:
            engine.submit(request, emitter(request.request_id, kind))
        except RequestError as e:
            outcomes[request.request_id].refused = e
            outcomes[request.request_id].done.set()
        if kind == "cancel_call":
            threading.Timer(rng.uniform(0.0, 0.05), engine.cancel, (request.request_id,)).start()
    for rid, outcome in outcomes.items():
        assert outcome.done.wait(120), f"request {rid} never finished"
    return outcomes


def _solo(engine: Engine, request: GenerationRequest) -> tuple[list[int], str | None, str | None]:
    alone = replace(request, request_id=request.request_id + "-alone", is_cancelled=None)
    [result] = generate(engine, [alone])
    sha = result.chunks[-1].adapter_sha256 if result.chunks else None
    return result.token_ids, result.finish_reason, sha


def _differs_from_alone(engine: Engine, oracle: TieOracle, request: GenerationRequest, tokens: list[int],
                        reason: str | None) -> tuple[str | None, str | None]:
    """How (tokens, reason) differs from the request's output alone (None when it does not), and the adapter
    version the run alone used. Where a greedy run and the run alone took different tokens that tie (see
    TieOracle.tie; an end-of-sequence token counts), the check goes on from the token this run took, against the
    request alone with the prompt extended by what this run generated up to and with it."""
    prompt, taken, sha = list(request.prompt_ids), 0, None
    while True:
        alone, alone_reason, alone_sha = _solo(engine, request)
        sha = sha or alone_sha
        got = tokens[taken:]
        if (got, reason) == (alone, alone_reason):
            return None, sha
        at = next((i for i, (x, y) in enumerate(zip(got, alone, strict=False)) if x != y), min(len(got), len(alone)))
        eos = min(engine.eos_ids)
        mine = got[at] if at < len(got) else eos if reason == "stop" else None
        theirs = alone[at] if at < len(alone) else eos if alone_reason == "stop" else None
        told = f"at token {taken + at}: {tokens} {reason} vs alone {alone} {alone_reason}"
        if mine is None or theirs is None or not is_greedy(request.sampling):
            return f"differs {told}", sha
        if not oracle.tie(request.adapter, prompt + tokens[: taken + at], mine, theirs):
            return f"takes {mine} where alone it takes {theirs}, no tie, {told}", sha
        taken += at + 1
        left = request.sampling.max_tokens - taken
        # past an end-of-sequence token nothing follows; stop strings would see a prompt, not output
        if at >= len(got) or left == 0 or request.sampling.stop:
            return None, sha
        request = replace(request, prompt_ids=prompt + tokens[:taken],
                          sampling=replace(request.sampling, max_tokens=left))


def _settled(engine: Engine) -> dict:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["running"] == 0 and stats["waiting"] == 0:
            return stats
        time.sleep(0.01)
    return engine.stats()


def test_no_request_changes_another_requests_output(engine, oracle):
    started, rounds = time.monotonic(), 0
    while rounds < 2 or time.monotonic() - started < FUZZ_SECONDS:
        seed = BASE_SEED + rounds
        rounds += 1
        rng = random.Random(seed)
        why = f"(fuzz seed {seed}; rerun with MANYLORA_FUZZ_SEED={seed})"
        mix = [(_innocent(rng, f"r{seed}-i{i}"), "innocent") for i in range(rng.randint(6, 14))]
        mix += [_hostile(rng, f"r{seed}-h{i}") for i in range(rng.randint(2, 8))]
        rng.shuffle(mix)
        errors_before = engine.stats()["errors"]
        outcomes = _run_mix(engine, rng, mix)
        stats = _settled(engine)
        assert stats["running"] == 0 and stats["waiting"] == 0, f"requests left in the engine {why}: {stats}"
        assert engine.pool.usage()["kv"] == 0, f"KV pages left allocated {why}"
        failed = 0
        for request, kind in mix:
            outcome = outcomes[request.request_id]
            last = outcome.last
            if kind == "innocent":
                assert outcome.refused is None and last is not None and last.error is None, \
                    f"innocent {request.request_id} failed {why}: {outcome.refused or last}"
                differs, sha = _differs_from_alone(engine, oracle, request, outcome.tokens, last.finish_reason)
                assert differs is None, f"innocent {request.request_id} {differs} {why}"
                assert last.adapter_sha256 == sha, f"{request.request_id}: another adapter version {why}"
            elif kind == "greedy":
                assert last is not None and last.error is None, f"{request.request_id}: {last} {why}"
                twin = replace(request, sampling=replace(request.sampling, temperature=0.0, seed=None))
                differs, _ = _differs_from_alone(engine, oracle, twin, outcome.tokens, last.finish_reason)
                assert differs is None, f"near-zero temperature is not greedy: {differs} {why}"
            elif kind == "refused":
                assert outcome.refused is not None and outcome.refused.code in (
                    ErrorCode.INVALID_ARG, ErrorCode.NOT_FOUND), f"{request.request_id} not refused {why}"
                failed += 1
            elif kind == "fails":
                assert last is not None and last.error is not None and last.error.code is ErrorCode.INTERNAL, \
                    f"{request.request_id}: {last} {why}"
                assert request.request_id in last.error.message
                failed += 1
            elif kind in ("cancel", "cancel_call"):
                assert last is not None and (last.error is None or last.error.code is ErrorCode.CANCELLED), why
                failed += last.error is not None
            elif kind == "raise_emit":
                failed += 1
            else:  # "any": ends one way or another
                assert outcome.refused is not None or last is not None, why
                failed += outcome.refused is not None or (last is not None and last.error is not None)
        assert engine.stats()["errors"] - errors_before == failed, f"error count off {why}"


def test_a_failing_forward_fails_only_its_request_before_its_state_advances(engine, oracle):
    good = [GenerationRequest(f"g{i}", _prompt(random.Random(i), 6), name, SamplingParams(max_tokens=8))
            for i, name in enumerate([None, "a", "b", None])]
    bad = GenerationRequest("poisoned", [0, 7, 8, POISON_FORWARD, 9], "a", SamplingParams(max_tokens=8))
    results = generate(engine, [good[0], bad, *good[1:]])
    assert results[1].error is not None and results[1].error.code is ErrorCode.INTERNAL
    assert "poisoned" in results[1].error.message and "injected forward fault" in results[1].error.message
    for request, result in zip(good, [results[0], *results[2:]], strict=True):
        assert result.error is None
        differs, _ = _differs_from_alone(engine, oracle, request, result.token_ids, result.finish_reason)
        assert differs is None, f"{request.request_id} {differs}"
    assert engine.pool.usage()["kv"] == 0


def test_the_tie_allowance_lets_no_other_difference_through(engine, oracle):
    rng = random.Random()
    for i in range(4):
        tokens: list[int] = []
        while not tokens:  # a request that ends at its first token has no token to change: draw another
            request = GenerationRequest(f"tie-check-{i}", _prompt(rng), rng.choice([None, "a", "b"]),
                                        SamplingParams(max_tokens=rng.randint(4, 24)))
            tokens, reason, _ = _solo(engine, request)
        assert _differs_from_alone(engine, oracle, request, tokens, reason)[0] is None
        at = rng.randrange(len(tokens))
        with torch.no_grad():
            logits = oracle.model(request.adapter)(torch.tensor([request.prompt_ids + tokens[:at]])).logits[0, -1]
        changed = [*tokens[:at], int(logits.argmin()), *tokens[at + 1:]]  # the least likely token: no tie
        assert f"at token {at}" in _differs_from_alone(engine, oracle, request, changed, reason)[0]
        assert _differs_from_alone(engine, oracle, request, tokens[:at], "stop")[0] is not None
