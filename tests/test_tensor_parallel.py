"""Tensor-parallel base + per-token LoRA, proven on CPU with gloo: TP=2 == TP=1 == transformers(+peft)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from manylora.engine.adapters.spec import parse_adapter_spec
from manylora.engine.adapters.weights import load_adapter_weights
from manylora.engine.layers.comm import Comm
from manylora.engine.model_config import PROJECTIONS, ModelConfig
from manylora.engine.models.llama import weight_names
from manylora.engine.models.loader import load_state_dict
from manylora.engine.parallel.lora import TPLoraBatch, lora_comm_elements_per_layer, shard_lora
from manylora.engine.parallel.sharding import (
    TensorParallelLlama,
    base_comm_elements_per_layer,
    check_tp,
    feature_slice,
    shard_state_dict,
)
from model_factory import make_base, write_random_adapter

MODES = (("replicated_a", "fold"), ("gather", "reduce"))
SEQ_LENS = [5, 4, 6, 3, 7]  # base, adapter 0, 1, 2, then a sequence with per-token mixed adapters
RANKS = (2, 4, 8)
ALPHAS = (8.0, None, 4.0)  # scalings 4, 2, 0.5
ATOL = 1e-4


def _batch() -> tuple[torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(2, 300, (sum(SEQ_LENS),), generator=g)
    slots = [-1] * 5 + [0] * 4 + [1] * 6 + [2] * 3 + [-1, 2, 0, 1, 1, -1, 0]
    assert len(slots) == sum(SEQ_LENS)
    return ids, slots


def _load(model_dir: str, adapter_dirs: list[str]):
    cfg = ModelConfig.from_dir(model_dir)
    tensors = load_state_dict(model_dir, weight_names(cfg), torch.float32, "cpu")
    loras = [load_adapter_weights(parse_adapter_spec(f"a{i}", d, cfg, 64), cfg).weights
             for i, d in enumerate(adapter_dirs)]
    return cfg, tensors, loras


def _worker(rank: int, world: int, init_file: str, model_dir: str, adapter_dirs: list[str], out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cfg, tensors, loras = _load(model_dir, adapter_dirs)
        comm = Comm.from_default_group()
        model = TensorParallelLlama(cfg, dict(tensors), comm)
        ids, slots = _batch()
        results: dict = {"weight_bytes": model.weight_bytes()}
        comm.log.clear()
        results["base"] = {"logits": model.forward(ids, SEQ_LENS, None), "log": list(comm.log)}
        for cm, rm in MODES:
            comm.log.clear()
            sharded = [shard_lora(w, cfg, rank, world, cm, rm) for w in loras]
            lora = TPLoraBatch(slots, sharded, comm, cm, rm)
            results[(cm, rm)] = {
                "logits": model.forward(ids, SEQ_LENS, lora),
                "log": list(comm.log),
                "lora_bytes": sum(m.a.numel() * 4 + m.b.numel() * 4 for s in sharded for m in s.values()),
            }
        torch.save(results, os.path.join(out_dir, f"tp{world}_rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _spawn(world: int, tmp: Path, model_dir: Path, adapter_dirs: list[Path]) -> list[dict]:
    init = tmp / f"init_{world}"
    mp.spawn(_worker, args=(world, str(init), str(model_dir), [str(d) for d in adapter_dirs], str(tmp)),
             nprocs=world, join=True)
    return [torch.load(tmp / f"tp{world}_rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp")
    model_dir = make_base(tmp / "base", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96)
    adapters = [write_random_adapter(tmp / f"a{i}", model_dir, rank=r, targets=list(PROJECTIONS), seed=10 + i,
                                     alpha=alpha) for i, (r, alpha) in enumerate(zip(RANKS, ALPHAS, strict=True))]
    runs = {world: _spawn(world, tmp, model_dir, adapters) for world in (1, 2)}
    return model_dir, adapters, runs


def _hf_reference(model_dir: Path, adapter_dirs: list[Path]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """(logits [T, V] from transformers with per-token LoRA hooks, {seq: logits} from peft for one-adapter seqs)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg, _, loras = _load(str(model_dir), [str(d) for d in adapter_dirs])
    ids, slots = _batch()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    current: dict[str, torch.Tensor] = {}

    def hook(layer: int, proj: str):
        def add_lora(_module, inputs, output):
            x, s = inputs[0][0], current["slots"]
            for k, w in enumerate(loras):
                a, b, scaling = w[(layer, proj)]
                mask = (s == k).to(x.dtype)[:, None]
                output[0] += scaling * mask * ((x @ a.t()) @ b.t())
            return output
        return add_lora

    for i, block in enumerate(model.model.layers):
        for proj in PROJECTIONS:
            parent = block.self_attn if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else block.mlp
            getattr(parent, proj).register_forward_hook(hook(i, proj))
    out, start = [], 0
    with torch.no_grad():
        for n in SEQ_LENS:
            current["slots"] = torch.tensor(slots[start:start + n])
            out.append(model(ids[start:start + n][None]).logits[0])
            start += n
    hooked = torch.cat(out)

    peft_logits = {}
    starts = [sum(SEQ_LENS[:i]) for i in range(len(SEQ_LENS))]
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        peft_logits[0] = base(ids[starts[0]:starts[0] + SEQ_LENS[0]][None]).logits[0]
        for k, d in enumerate(adapter_dirs):
            base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            pm = PeftModel.from_pretrained(base, d).eval()
            seq = k + 1
            peft_logits[seq] = pm(ids[starts[seq]:starts[seq] + SEQ_LENS[seq]][None]).logits[0]
    return hooked, peft_logits


def test_tp2_matches_tp1_and_transformers(setup):
    model_dir, adapters, runs = setup
    tp1, tp2 = runs[1][0], runs[2]
    hooked, peft_logits = _hf_reference(model_dir, adapters)
    starts = [sum(SEQ_LENS[:i]) for i in range(len(SEQ_LENS))]
    report = []
    for key in ("base", *MODES):
        ref = tp1[key]["logits"]
        # the two ranks compute identical logits (lm_head replicated)
        torch.testing.assert_close(tp2[0][key]["logits"], tp2[1][key]["logits"], atol=0, rtol=0)
        d_tp = (tp2[0][key]["logits"] - ref).abs().max().item()
        assert d_tp < ATOL, (key, d_tp)
        if key == "base":
            continue
        d_hf = (tp2[0][key]["logits"] - hooked).abs().max().item()
        assert d_hf < ATOL, (key, d_hf)
        d_peft = 0.0
        for seq, logits in peft_logits.items():
            got = tp2[0][key]["logits"][starts[seq]:starts[seq] + SEQ_LENS[seq]]
            d_peft = max(d_peft, (got - logits).abs().max().item())
        assert d_peft < ATOL, (key, d_peft)
        report.append(f"{key}: |tp2-tp1|={d_tp:.2e} |tp2-hf hooks|={d_hf:.2e} |tp2-peft|={d_peft:.2e} "
                      f"lora bytes/rank tp1={tp1[key]['lora_bytes']} tp2={tp2[0][key]['lora_bytes']}")
    # LoRA changes the output, so the checks above are not vacuous
    assert (tp1[MODES[0]]["logits"] - tp1["base"]["logits"]).abs().max() > 0.1
    report.append(f"base weight bytes/rank tp1={tp1['weight_bytes']} tp2={tp2[0]['weight_bytes']}")
    print("\n" + "\n".join(report))


def test_communication_volume_is_base_plus_t_times_r(setup):
    model_dir, _, runs = setup
    cfg = ModelConfig.from_dir(model_dir)
    T, L, H, R = sum(SEQ_LENS), cfg.num_layers, cfg.hidden_size, max(RANKS)
    for world, ranks in runs.items():
        for rank_result in ranks:
            for key in ("base", *MODES):
                log = rank_result[key]["log"]
                base = sum(r.elements for r in log if r.kind == "base")
                lora = sum(r.elements for r in log if r.kind == "lora")
                assert base == L * base_comm_elements_per_layer(T, H, world)
                expect = 0 if key == "base" else L * lora_comm_elements_per_layer(T, R, world, *key)
                assert lora == expect, (world, key, lora, expect)
                if world == 2:
                    # fused: LoRA's row-parallel columns travel in the base all-reduces, no extra calls
                    assert sum(r.op == "all_reduce" and r.kind == "base" for r in log) == 2 * L
    two = runs[2][0]
    assert two[MODES[0]]["log"] and not [r for r in two[MODES[0]]["log"] if r.kind == "lora"]
    print(f"\nT={T} H={H} r={R} per layer elements: base {base_comm_elements_per_layer(T, H, 2)}, "
          f"lora {[lora_comm_elements_per_layer(T, R, 2, *m) for m in MODES]} for {list(MODES)}")


def test_lora_comm_formula_is_order_t_r():
    for cm, rm in MODES:
        f = lambda t, r, cm=cm, rm=rm: lora_comm_elements_per_layer(t, r, 2, cm, rm)  # noqa: E731
        assert f(64, 8) * 2 == f(128, 8) == f(64, 16)  # linear in T and in r, independent of H
        assert f(64, 8) <= 7 * 64 * 8  # at most one (T, r) per adapted projection
        assert lora_comm_elements_per_layer(64, 8, 1, cm, rm) == 0
    assert lora_comm_elements_per_layer(64, 8, 4, "replicated_a", "fold") == 0
    assert lora_comm_elements_per_layer(10, 8, 2, "gather", "reduce") == 5 * 10 * 8 + 2 * 10 * 8
    assert lora_comm_elements_per_layer(10, 3, 2, "gather", "fold") == 5 * 10 * 4  # r padded to a multiple of tp
    # Llama-2-7B-like, T = 256, r = 16, tp = 4: LoRA's extra payload vs the base's 2 all-reduces of T x H
    base = base_comm_elements_per_layer(256, 4096, 4)
    assert lora_comm_elements_per_layer(256, 16, 4, "gather", "reduce") / base < 0.015


def test_check_tp_rejects_uneven_heads():
    cfg = _tiny_cfg()
    check_tp(cfg, 2)
    with pytest.raises(ValueError, match="num_key_value_heads=2 divisible by 4"):
        check_tp(cfg, 4)
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        check_tp(cfg, 3)


def _tiny_cfg() -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})


def test_shards_reassemble_to_the_full_weights():
    cfg = _tiny_cfg()
    g = torch.Generator().manual_seed(0)
    full = {}
    for proj in PROJECTIONS:
        n_in, n_out = cfg.projection_shape(proj)
        part = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        full[f"model.layers.0.{part}.{proj}.weight"] = torch.randn(n_out, n_in, generator=g)
    full["model.embed_tokens.weight"] = torch.randn(300, 64, generator=g)
    shards = [shard_state_dict(full, cfg, r, 2) for r in range(2)]
    for name, t in full.items():
        proj = name.split(".")[-2]
        dim = 1 if proj in ("o_proj", "down_proj") else 0
        if name.startswith("model.embed"):
            assert all(s[name] is t for s in shards)
        else:
            assert shards[0][name].shape[dim] == t.shape[dim] // 2
            torch.testing.assert_close(torch.cat([s[name] for s in shards], dim=dim), t)
    assert feature_slice(cfg, "k_proj", 1, 2) == slice(16, 32)  # KV head 1 of 2 (head_dim 16)


def test_lora_partition_math_without_processes():
    """Each scheme's per-rank pieces recombine to the unsharded delta (what the collectives compute)."""
    cfg = _tiny_cfg()
    g = torch.Generator().manual_seed(1)
    r, T, tp = 3, 5, 2  # odd rank: S-LoRA's split pads it to 4
    weights = {}
    for proj in PROJECTIONS:
        n_in, n_out = cfg.projection_shape(proj)
        weights[(0, proj)] = (torch.randn(r, n_in, generator=g), torch.randn(n_out, r, generator=g), 0.5)
    for cm, rm in MODES:
        parts = [shard_lora(weights, cfg, k, tp, cm, rm) for k in range(tp)]
        for proj in PROJECTIONS:
            a, b, s = weights[(0, proj)]
            n_in, _ = cfg.projection_shape(proj)
            x = torch.randn(T, n_in, generator=g)
            want = s * (x @ a.t()) @ b.t()
            if proj in ("o_proj", "down_proj"):  # x split by features; sum of partial deltas
                got = sum(s * (x[:, feature_slice(cfg, proj, k, tp)] @ p[(0, proj)].a.t()) @ p[(0, proj)].b.t()
                          for k, p in enumerate(parts))
            else:
                if cm == "gather":  # all-gathered shrink, in rank order
                    y = torch.cat([x @ p[(0, proj)].a.t() for p in parts], dim=1)
                else:
                    y = x @ parts[0][(0, proj)].a.t()
                got = torch.cat([s * y @ p[(0, proj)].b.t() for p in parts], dim=1)  # output shards
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
