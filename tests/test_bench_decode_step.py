"""perf/engine/bench_decode_step.py's floor: the base weights a decode step reads (CPU, a tiny random model)."""

import pytest
import torch

from manylora.engine.model_config import ModelConfig
from perf.engine.bench_decode_step import random_model, step_weight_bytes
from perf.engine.shapes import SHAPES


@pytest.mark.parametrize("tied", [False, True])
def test_step_reads_the_batch_rows_of_an_untied_embedding_table(tied):
    cfg = ModelConfig.from_dict({**SHAPES["tiny"], "tie_word_embeddings": tied})
    model = random_model(cfg, 32, "cpu", torch.bfloat16)
    table = cfg.vocab_size * cfg.hidden_size * 2
    every = model.weight_bytes()
    for batch in (1, 7, 64):
        if tied:  # the LM head reads the whole table every step
            assert step_weight_bytes(model, batch) == every
        else:
            assert step_weight_bytes(model, batch) == every - table + batch * cfg.hidden_size * 2
    assert every == sum(t.numel() * 2 for t in _tensors(model)), "weight_bytes counts each tensor once"


def _tensors(model):
    seen = {}
    for t in [model.embed, model.lm_head, model.final_norm]:
        seen[t.data_ptr()] = t
    for w in model.layers:
        for name, t in vars(w).items():
            if isinstance(t, torch.Tensor) and name != "qk_norm":
                seen[t.data_ptr()] = t
    return list(seen.values())
