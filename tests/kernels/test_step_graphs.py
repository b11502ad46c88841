"""Mixed-step graphs (manylora/engine/execution/step_graphs.py): prefill chunks and decodes in one padded,
graph-shaped step.

On the CPU (Triton interpreter) the engine's mixed steps go through ``MixedStepGraphs.run_eager``: the forward a
graph captures, over the same padded buffers (bucket padding, per-token block-table rows, logits rows, adapter
tables), with no graph. On a GPU (TRITON_INTERPRET=0) the engine captures and replays them. Either way the tokens
must be PEFT's.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from manylora.engine.config import EngineConfig, parse_token_buckets
from manylora.engine.execution.step_graphs import MixedInputs, MixedStepGraphs, token_buckets
from manylora.engine.memory.unified_pool import ReservedPage
from manylora.engine.scheduling.engine import Engine
from model_factory import assert_generations_match_peft, assert_pool_drained, make_base, write_random_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_token_buckets_end_at_the_step_budget():
    assert token_buckets(4096)[:10] == [64, 128, 192, 256, 320, 384, 448, 512, 576, 640]
    assert token_buckets(4096)[-4:] == [3328, 3584, 3840, 4096]
    assert token_buckets(100) == [64, 100]
    assert token_buckets(64) == [64]
    assert token_buckets(10) == [10]
    assert token_buckets(1000) == [64, 128, 192, 256, 320, 384, 448, 512, 576, 640, 704, 768, 832, 896, 960, 1000]


@pytest.mark.parametrize("max_tokens", [513, 1000, 4096, 5000, 16384])
def test_token_buckets_pad_a_large_step_by_less_than_an_eighth(max_tokens):
    """Above 512 tokens (where a step's GEMMs are bound by compute) no step is padded by 1/8 of its size or more;
    below, by less than 64 tokens."""
    buckets = token_buckets(max_tokens)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_tokens
    for tokens in range(1, max_tokens + 1):
        bucket = next(b for b in buckets if b >= tokens)
        assert bucket - tokens < (64 if tokens <= 512 else tokens / 8), (tokens, bucket)


def test_explicit_token_buckets_replace_the_spread():
    assert token_buckets(4096, (512, 64, 8192)) == [64, 512, 4096]
    assert parse_token_buckets(" 768, 256,256 ") == (256, 768)
    assert parse_token_buckets("") == ()
    for bad in ("0,64", "64;128", "-64", "x"):
        with pytest.raises(ValueError, match="mixed_step_buckets"):
            EngineConfig(model_dir="unused", mixed_step_buckets=bad)


def _attach_eager_mixed_graphs(engine: Engine) -> list[int]:
    """CPU: give the engine mixed-step 'graphs' that run their forward over the padded buffers; returns the list
    the bucket of each such step is appended to."""
    cfg = engine.config
    scratch = engine.pool.pages.allocate(ReservedPage("mixed-step padding"), 1)[0]
    mixed = MixedStepGraphs(engine.model, engine.kv, scratch, cfg.max_num_batched_tokens, cfg.max_num_seqs,
                            engine.kv.pages_needed(engine.max_len), cfg.max_loras, cfg.max_lora_rank)
    buckets: list[int] = []
    run_eager = mixed.run_eager

    def run(inputs):
        buckets.append(next(b for b in mixed.buckets if b >= len(inputs.input_ids)))
        mixed.replays[bool(inputs.adapters)] += 1  # what a replay counts
        return run_eager(inputs)

    mixed.run = run
    engine.mixed_graphs = mixed
    return buckets


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_mixed_steps_match_peft(tmp_path, device, family):
    """Adapters of mixed ranks and base-only requests, prompts of 1 to 90 tokens (a step holds prefill chunks of
    several sequences, decodes beside them, and chunks split over steps by the token budget): every token equals
    PEFT's, steps of both buckets ran through the mixed path, and the pool ends empty. On the CPU (the interpreter
    takes ~100 s a case) the Llama case only."""
    if device == "cpu" and family != "llama":
        pytest.skip("one family on the CPU (the interpreter is slow); both compiled")
    extra = {"qwen3": {"head_dim": 24}}.get(family, {})
    base = make_base(tmp_path / "base", family, seed=71, **extra)
    rng = random.Random(family)
    adapters = {f"m{i}": str(write_random_adapter(tmp_path / f"m{i}", base, rank=rank,
                                                  targets=rng.sample(ALL, rng.randint(2, 7)), seed=80 + i))
                for i, rank in enumerate([2, 8, 16])}
    engine = Engine(EngineConfig(model_dir=str(base), adapters=adapters, device=device, dtype="float32",
                                 kernels="triton", max_lora_rank=16, page_size=8, max_num_seqs=8,
                                 max_num_batched_tokens=96, warmup=False), start=device != "cpu")
    try:
        buckets = None
        if device == "cpu":
            assert engine.mixed_graphs is None
            buckets = _attach_eager_mixed_graphs(engine)
            engine.start()
        else:
            assert engine.mixed_graphs is not None and engine.mixed_graphs.buckets == [64, 96]
        names = [None, *adapters]
        cases = [([0] + [rng.randrange(2, 290) for _ in range(n)], names[i % len(names)])
                 for i, n in enumerate([90, 3, 40, 1, 17, 60, 8, 25])]
        assert_generations_match_peft(engine, base, adapters, cases, 4, "x")
        if buckets is not None:
            assert set(buckets) == {64, 96}, buckets
        else:
            assert engine.mixed_graphs.replays[True] >= 2, engine.mixed_graphs.replays
        stats = engine.stats()  # the step kinds an operator (and the capacity benchmark) reads
        assert stats["mixed_step_buckets"] == [64, 96]
        assert stats["steps_mixed_graph"] == sum(engine.mixed_graphs.replays.values()) >= 2
        assert stats["steps_decode_graph"] + stats["steps_mixed_graph"] + stats["steps_eager"] == stats["steps"]
        assert (stats["steps_decode_graph"] > 0) == (device != "cpu")  # no decode graphs on the CPU
        assert_pool_drained(engine)
    finally:
        engine.shutdown()


@contextlib.contextmanager
def _standalone_graphs(tmp_path, max_tokens: int, seed: int, device: str = "cpu"):
    """A float32 engine of 4 sequences (8-token pages, no CUDA graphs of its own) and mixed-step graphs of up to
    ``max_tokens`` tokens over its pool, built but not captured: (engine, scratch page, graphs)."""
    base = make_base(tmp_path / "base", "llama", seed=seed)
    engine = Engine(EngineConfig(model_dir=str(base), device=device, dtype="float32", max_num_seqs=4,
                                 max_num_batched_tokens=max_tokens, page_size=8, warmup=False, cuda_graphs=False),
                    start=False)
    try:
        scratch = engine.pool.pages.allocate(ReservedPage("mixed-step padding"), 1)[0]
        yield engine, scratch, MixedStepGraphs(engine.model, engine.kv, scratch, max_tokens, 4, 6, 2, 16)
    finally:
        engine.shutdown()


def test_load_pads_the_step_to_its_bucket(tmp_path):
    """What a replay reads after ``load``: the real tokens' ids, positions, KV slots, sequence rows (context = own
    position + 1) and adapter slots, then padding up to the bucket that writes and reads only the scratch page and
    has no adapter; each sequence's block table (short ones padded with the scratch page) beside the padding row;
    the sampled rows, then row 0."""
    with _standalone_graphs(tmp_path, 100, seed=3) as (engine, scratch, mixed):
        rng = random.Random(9)
        # a 5-token prefill chunk of sequence 0 (positions 3..7) and a decode of sequence 1 (position 20)
        positions = [3, 4, 5, 6, 7, 20]
        ids = [rng.randrange(2, 200) for _ in positions]
        kv_slots = [rng.randrange(0, 400) for _ in positions]
        tables = [[5, 9], [2, 7, 11]]
        size = mixed.load(MixedInputs(input_ids=ids, positions=positions, kv_slots=kv_slots,
                                      table_rows=[0] * 5 + [1], block_tables=tables, logits_rows=[4, 5],
                                      token_slots=[1] * 5 + [-1], adapters=[]))
        assert size == 64 and mixed.buckets == [64, 100]
        n, pad = len(ids), slice(len(ids), 64)
        assert mixed.input_ids[:n].tolist() == ids and mixed.positions[:n].tolist() == positions
        assert mixed.kv_slots[:n].tolist() == kv_slots
        assert mixed.seq_lens[:n].tolist() == [p + 1 for p in positions]
        assert mixed.table_rows[:n].tolist() == [0] * 5 + [1]
        assert mixed.token_slots[:n].tolist() == [1] * 5 + [-1]
        assert set(mixed.kv_slots[pad].tolist()) == {scratch * engine.kv.page_size}
        assert set(mixed.seq_lens[pad].tolist()) == {1} and set(mixed.token_slots[pad].tolist()) == {-1}
        assert set(mixed.table_rows[pad].tolist()) == {4}  # the padding row, after max_seqs sequences
        assert mixed.block_tables[0, :3].tolist() == [5, 9, scratch]
        assert mixed.block_tables[1, :3].tolist() == [2, 7, 11]
        assert set(mixed.block_tables[4].tolist()) == {scratch}
        assert mixed.logits_rows.tolist() == [4, 5, 0, 0]
        # a smaller step next: the last one's tokens past it are padding again
        mixed.load(MixedInputs(input_ids=[7], positions=[8], kv_slots=[3], table_rows=[0], block_tables=[[5, 9]],
                               logits_rows=[0], token_slots=[-1], adapters=[]))
        assert mixed.seq_lens[:6].tolist() == [9, 1, 1, 1, 1, 1] and mixed.logits_rows.tolist() == [0, 0, 0, 0]
        assert set(mixed.table_rows[1:64].tolist()) == {4}


def test_a_shared_logits_buffer_holds_what_the_forward_returns(tmp_path, device):
    """The mixed-step graphs write their logits into one buffer (``LlamaModel.logits_out``) instead of keeping a
    tensor each in their pool: the forward must return a view of it with the very values it returns without."""
    with _standalone_graphs(tmp_path, 64, seed=5, device=device) as (engine, _, mixed):
        rng = random.Random(11)
        positions = [0, 1, 2, 3, 9]
        inputs = MixedInputs(input_ids=[rng.randrange(2, 200) for _ in positions], positions=positions,
                             kv_slots=[8, 9, 10, 11, 25], table_rows=[0, 0, 0, 0, 1], block_tables=[[1], [2, 3]],
                             logits_rows=[3, 4], token_slots=[-1] * 5, adapters=[])
        alone = mixed.run_eager(inputs).clone()
        mixed.logits.fill_(float("nan"))
        engine.model.logits_out = mixed.logits
        try:
            shared = mixed.run_eager(inputs)
        finally:
            engine.model.logits_out = None
        assert shared.data_ptr() == mixed.logits.data_ptr() and shared.dtype == torch.float32
        assert torch.equal(shared, alone) and not torch.isnan(alone).any()


@pytest.mark.parametrize("fail_at", [0, 3, None])
def test_out_of_memory_capturing_the_finer_buckets_keeps_the_coarse_ones(tmp_path, monkeypatch, caplog, fail_at):
    """The coarse buckets are captured first; running out of memory among the finer ones keeps every bucket captured
    whole (with and without LoRA) and says so; among the coarse ones it raises (the engine then runs eagerly)."""
    with _standalone_graphs(tmp_path, 1100, seed=2) as (engine, scratch, mixed):
        every = list(mixed.buckets)
        core = [64, 128, 192, 256, 384, 512, 768, 1024, 1100]
        finer = sorted(set(every) - set(core), reverse=True)
        captured: list[tuple[int, bool]] = []

        def fake_capture(model, kv, batch, lora, pool, gemms=None, logits_out=None):
            size, with_lora = batch.input_ids.shape[0], lora is not None
            if fail_at is not None and size == finer[fail_at] and not with_lora:  # after its LoRA graph
                raise torch.cuda.OutOfMemoryError("test: out of memory")
            captured.append((size, with_lora))
            return f"graph {size} {with_lora}", logits_out

        monkeypatch.setattr("manylora.engine.execution.step_graphs.capture_forward", fake_capture)
        with caplog.at_level("WARNING", logger="manylora.step_graphs"):
            mixed.capture_all()
        assert [size for size, lora in captured if lora][: len(core)] == core[::-1]  # coarse first, biggest first
        if fail_at is None:
            assert mixed.buckets == every and not caplog.records
        else:
            kept = sorted(core + finer[:fail_at])
            assert mixed.buckets == kept and mixed.buckets[-1] == 1100
            assert sorted({size for size, _ in mixed._graphs}) == kept and len(mixed._graphs) == 2 * len(kept)
            assert f"{len(every)} token buckets; {len(kept)} captured" in caplog.text
        with pytest.raises(torch.cuda.OutOfMemoryError):
            monkeypatch.setattr("manylora.engine.execution.step_graphs.capture_forward",
                                lambda *a, **k: (_ for _ in ()).throw(torch.cuda.OutOfMemoryError("coarse")))
            MixedStepGraphs(engine.model, engine.kv, scratch, 1100, 4, 6, 2, 16).capture_all()
