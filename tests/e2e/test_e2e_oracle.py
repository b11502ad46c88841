"""The oracle: greedy output through the server == transformers + peft, float32, token for token.

Every adapter of the catalogue and the base model, requests sent concurrently so that the
engine's batches mix adapters, ranks and base requests.
"""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytestmark = pytest.mark.e2e

PROMPTS = (
    "In the morning the baker",
    "On the corner of the square there is a small caf",
    "The old men",
    "Marcel writes the menu of his café on a black board by the door and every day",
)
MAX_NEW_TOKENS = 16


def _peft_greedy(model, input_ids: list[int], eos_ids: set[int], pad_id: int) -> list[int]:
    x = torch.tensor([input_ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            eos_token_id=sorted(eos_ids),
            pad_token_id=pad_id,
        )
    ids = out[0, len(input_ids) :].tolist()
    for i, t in enumerate(ids):  # the engine stops at EOS and does not return it
        if t in eos_ids:
            return ids[:i]
    return ids


@pytest.fixture(scope="module")
def reference(server, tokenizer):
    return peft_reference(server, tokenizer)


def peft_reference(server, tokenizer) -> dict[tuple[str | None, str], list[int]]:
    """(adapter or None, prompt) -> PEFT greedy token ids, for the server's base model and catalogue."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, GenerationConfig

    base = AutoModelForCausalLM.from_pretrained(str(server.base_model), dtype=torch.float32).eval()
    gen = GenerationConfig.from_pretrained(str(server.base_model))
    eos = gen.eos_token_id if gen.eos_token_id is not None else base.config.eos_token_id
    eos_ids = set(eos) if isinstance(eos, list) else {eos}
    pad = gen.pad_token_id if gen.pad_token_id is not None else next(iter(eos_ids))
    models = {None: base}
    for name, path in server.catalogue.items():
        models[name] = PeftModel.from_pretrained(copy.deepcopy(base), path).eval()
    out = {}
    for name, model in models.items():
        for prompt in PROMPTS:
            ids = tokenizer.encode(prompt, add_special_tokens=True).ids
            out[(name, prompt)] = _peft_greedy(model, ids, eos_ids, pad)
    return out


def test_token_ids_match_peft_in_mixed_batches(server, client, tokenizer, reference):
    check_mixed_batches(client, tokenizer, reference, server.catalogue)


def check_mixed_batches(client, tokenizer, reference: dict, catalogue: dict) -> None:
    """Every (adapter, prompt) of reference at once (streamed and not): token ids equal PEFT's."""
    jobs = list(reference)
    jobs = jobs[::2] + jobs[1::2]  # interleave adapters and the base
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {
            job: pool.submit(
                client.generate_ids,
                tokenizer.encode(job[1], add_special_tokens=True).ids,
                adapter=job[0],
                max_tokens=MAX_NEW_TOKENS,
                stream=bool(i % 2),
            )
            for i, job in enumerate(jobs)
        }
        got = {job: f.result() for job, f in futures.items()}
    mismatches = {job: (got[job], reference[job]) for job in jobs if got[job] != reference[job]}
    assert not mismatches, f"{len(mismatches)}/{len(jobs)} differ from PEFT: {mismatches}"
    # the adapters really change the output
    assert len({tuple(reference[(name, PROMPTS[0])]) for name in [None, *catalogue]}) > 1


def test_text_matches_peft_through_the_ensemble(server, client, tokenizer, reference):
    jobs = list(reference)
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {
            job: pool.submit(
                (lambda j: "".join(client.stream(j[1], adapter=j[0], max_tokens=MAX_NEW_TOKENS)))
                if i % 2
                else (lambda j: client.generate(j[1], adapter=j[0], max_tokens=MAX_NEW_TOKENS)),
                job,
            )
            for i, job in enumerate(jobs)
        }
        got = {job: f.result() for job, f in futures.items()}
    expected = {job: tokenizer.decode(ids, skip_special_tokens=True) for job, ids in reference.items()}
    mismatches = {job: (got[job], expected[job]) for job in jobs if got[job] != expected[job]}
    assert not mismatches, mismatches
