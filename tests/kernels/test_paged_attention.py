"""Paged decode attention against the torch reference.

KV pages sit in a flat pool that also holds other layers and unused pages (random values
everywhere); block tables point at shuffled, non-contiguous pages, padded with out-of-range
page numbers past each sequence's end (never to be read). Outputs are poisoned with NaN.
"""

from __future__ import annotations

import os
import zlib

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest does it too)

import pytest  # noqa: E402
import torch  # noqa: E402

from manylora.kernels.paged_attention import paged_decode_attention  # noqa: E402
from manylora.kernels.reference import ref_paged_decode_attention  # noqa: E402

TOL = {"rtol": 1e-4, "atol": 1e-4}


def seed_of(*key: object) -> int:
    return zlib.crc32(repr(key).encode())


def make_case(seed, seq_lens, num_kv_heads, group, head_dim, page_size, num_layers=3, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    pages_needed = [(n + page_size - 1) // page_size for n in seq_lens]
    num_pages = sum(pages_needed) + 5  # spare pages hold garbage too
    page_elems = num_layers * 2 * page_size * num_kv_heads * head_dim
    pool = torch.randn(num_pages * page_elems + 37, generator=gen)  # a ragged tail: not a whole page
    perm = torch.randperm(num_pages, generator=gen).tolist()
    max_blocks = max(pages_needed) + 2
    block_tables = torch.full((batch, max_blocks), 10**6, dtype=torch.int32)  # padding: never read
    for b, n in enumerate(pages_needed):
        block_tables[b, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    q = torch.randn(batch, num_kv_heads * group, head_dim, generator=gen)
    layer = int(torch.randint(num_layers, (1,), generator=gen))
    return {
        "q": q.to(dtype),
        "pool": pool.to(dtype),
        "block_tables": block_tables,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "scale": head_dim**-0.5,
        "layer": layer,
        "num_layers": num_layers,
        "page_size": page_size,
        "num_kv_heads": num_kv_heads,
    }


def run_both(case, device, config=None, q_view=None):
    keys = ("layer", "num_layers", "page_size", "num_kv_heads")
    kw = {k: case[k] for k in keys}
    q = case["q"]
    expected = torch.full(q.shape, float("nan"), dtype=q.dtype)
    ref_paged_decode_attention(q, case["pool"], case["block_tables"], case["seq_lens"], case["scale"], expected, **kw)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=device)
    paged_decode_attention(
        q.to(device) if q_view is None else q_view,
        case["pool"].to(device),
        case["block_tables"].to(device),
        case["seq_lens"].to(device),
        case["scale"],
        out,
        config=config,
        **kw,
    )
    return out.cpu(), expected


def run_rows(case, q, table_rows, seq_lens, device, config=None):
    """Kernel and reference over query rows q that read the block tables of rows ``table_rows`` with lengths
    ``seq_lens`` (prefill rows); the kernel's output on the CPU and the reference's."""
    kw = {k: case[k] for k in ("layer", "num_layers", "page_size", "num_kv_heads")}
    expected = torch.full(q.shape, float("nan"))
    ref_paged_decode_attention(q, case["pool"], case["block_tables"], seq_lens, case["scale"], expected,
                               table_rows=table_rows, **kw)
    out = torch.full(q.shape, float("nan"), device=device)
    paged_decode_attention(q.to(device), case["pool"].to(device), case["block_tables"].to(device),
                           seq_lens.to(device), case["scale"], out, table_rows=table_rows.to(device), config=config,
                           **kw)
    return out.cpu(), expected


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("head_dim", [32, 40])
def test_paged_decode_attention(device, page_size, group, head_dim):
    gen = torch.Generator().manual_seed(seed_of("lens", page_size, group, head_dim))
    seq_lens = [1, 5, 33, 70]
    seq_lens = [seq_lens[i] for i in torch.randperm(4, generator=gen).tolist()]
    case = make_case(seed_of("attn", page_size, group, head_dim), seq_lens, 2, group, head_dim, page_size)
    out, expected = run_both(case, device)
    assert not expected.isnan().any()
    torch.testing.assert_close(out, expected, **TOL)


def test_long_and_short_mix(device):
    """A long sequence beside length-1 ones, several BLOCK_N iterations, 8 query heads per kv head."""
    case = make_case(seed_of("long"), [1, 300, 1, 17], 1, 8, 64, 16, num_layers=2)
    out, expected = run_both(case, device)
    torch.testing.assert_close(out, expected, **TOL)


def test_small_blocks_and_strided_q(device):
    """BLOCK_N smaller than a page; q a strided slice of a fused qkv tensor; zero-length sequence."""
    case = make_case(seed_of("small"), [0, 70, 5, 33], 2, 4, 32, 16)
    qkv = torch.randn(4, 8 + 2 * 2, 32).to(device)
    qkv[:, :8] = case["q"].to(device)
    out, expected = run_both(case, device, config={"BLOCK_G": 16, "BLOCK_N": 16, "BLOCK_D": 32}, q_view=qkv[:, :8])
    torch.testing.assert_close(out, expected, **TOL)
    assert (out[0] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(device, dtype):
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("triton's interpreter computes bf16 tl.dot wrongly (triton 3.9); checked on GPU only")
    case = make_case(seed_of("half", str(dtype)), [1, 5, 33, 70], 2, 4, 64, 16, dtype=dtype)
    out, expected = run_both(case, device)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_argument_errors(device):
    case = make_case(seed_of("err"), [3, 5], 2, 2, 32, 4)
    kw = {k: case[k] for k in ("layer", "num_layers", "page_size", "num_kv_heads")}
    q, pool = case["q"].to(device), case["pool"].to(device)
    bt, lens = case["block_tables"].to(device), case["seq_lens"].to(device)
    out = torch.empty_like(q)
    with pytest.raises(TypeError, match="block_tables"):
        paged_decode_attention(q, pool, bt.long(), lens, 1.0, out, **kw)
    with pytest.raises(ValueError, match="num_kv_heads"):
        paged_decode_attention(q, pool, bt, lens, 1.0, out, **{**kw, "num_kv_heads": 3})
    with pytest.raises(ValueError, match="layer"):
        paged_decode_attention(q, pool, bt, lens, 1.0, out, **{**kw, "layer": 3})
    with pytest.raises(ValueError, match="out"):
        paged_decode_attention(q, pool, bt, lens, 1.0, out[:1], **kw)


@pytest.mark.parametrize("group", [1, 4])
def test_prefill_rows_share_their_sequence_table(device, group):
    """Query rows of prefill chunks read their sequence's block table (table_rows) with causal
    lengths (position + 1): the same as the reference, row by row."""
    gen = torch.Generator().manual_seed(seed_of("table_rows", group))
    contexts = [9, 40, 3]  # three sequences' cached lengths after the step
    case = make_case(seed_of("table_rows", group, 1), contexts, num_kv_heads=2, group=group, head_dim=32, page_size=4)
    rows, lens = [], []
    for s, ctx in enumerate(contexts):  # each sequence's last few tokens are this step's queries
        chunk = int(torch.randint(1, ctx + 1, (1,), generator=gen))
        rows += [s] * chunk
        lens += list(range(ctx - chunk + 1, ctx + 1))
    rows += [1]  # and a decode-like row of sequence 1
    lens += [40]
    n = len(rows)
    q = torch.randn(n, 2 * group, 32, generator=gen)
    table_rows = torch.tensor(rows, dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out, expected = run_rows(case, q, table_rows, seq_lens, device)
    torch.testing.assert_close(out, expected, **TOL)
    # and the reference itself agrees with plain causal attention over each sequence's gathered keys
    page_elems = case["num_layers"] * 2 * 4 * 2 * 32
    kv = case["pool"][: (case["pool"].numel() // page_elems) * page_elems].view(-1, case["num_layers"], 2, 4, 2, 32)
    for i in range(n):
        t, length = rows[i], lens[i]
        pages = case["block_tables"][t, : (length + 3) // 4].long()
        k = kv[pages, case["layer"], 0].reshape(-1, 2, 32)[:length].repeat_interleave(group, dim=1)
        v = kv[pages, case["layer"], 1].reshape(-1, 2, 32)[:length].repeat_interleave(group, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[i], k) * case["scale"], dim=-1)
        torch.testing.assert_close(expected[i], torch.einsum("hn,nhd->hd", w, v), **TOL)


@pytest.mark.parametrize("splits", [2, 3, 16])
def test_context_splits(device, splits):
    """Split over the context: lengths of 0, 1, a few blocks and many blocks in one launch, so that some runs are
    empty, some partial, some whole (BLOCK_N 16 over pages of 4); every split count merges to the reference."""
    case = make_case(seed_of("splits", splits), [300, 0, 1, 37, 16, 129], 2, 4, 32, 4)
    config = {"BLOCK_G": 16, "BLOCK_N": 16, "BLOCK_D": 32, "SPLITS": splits}
    out, expected = run_both(case, device, config=config)
    torch.testing.assert_close(out, expected, **TOL)
    assert (out[1] == 0).all()


def test_context_splits_with_table_rows(device):
    """Prefill rows that share their sequence's table, split over their (causal) lengths."""
    case = make_case(seed_of("split_rows"), [70, 9], num_kv_heads=1, group=8, head_dim=40, page_size=16)
    table_rows = torch.tensor([0, 0, 0, 1, 1], dtype=torch.int32)
    seq_lens = torch.tensor([1, 35, 70, 8, 9], dtype=torch.int32)
    q = torch.randn(5, 8, 40, generator=torch.Generator().manual_seed(seed_of("split_rows_q")))
    out, expected = run_rows(case, q, table_rows, seq_lens, device,
                             config={"BLOCK_G": 16, "BLOCK_N": 16, "BLOCK_D": 64, "SPLITS": 4})
    torch.testing.assert_close(out, expected, **TOL)


def test_split_count_follows_the_batch(monkeypatch):
    """attention_splits: the largest power of two that keeps the programs within two per SM, capped; one split
    from half that many programs up; the CPU never splits; MANYLORA_ATTENTION_SPLITS's override wins."""
    from manylora.kernels import paged_attention as pa

    gpu = torch.device("cuda", 0)
    monkeypatch.setitem(pa._SM_COUNTS, gpu, 132)  # the H200's; no GPU needed to ask
    monkeypatch.setattr(pa, "SPLITS_OVERRIDE", None)
    assert pa.attention_splits(64, 8, gpu) == 1  # 512 programs > 264
    assert pa.attention_splits(32, 8, gpu) == 1  # 256: a second split would make 512
    assert pa.attention_splits(16, 8, gpu) == 2  # 128 x 2 = 256
    assert pa.attention_splits(12, 8, gpu) == 2  # 96: 264 // 96 = 2
    assert pa.attention_splits(4, 8, gpu) == 8
    assert pa.attention_splits(1, 8, gpu) == 32 == pa.MAX_SPLITS  # 264 // 8 = 33
    assert pa.attention_splits(1, 2, gpu) == pa.MAX_SPLITS  # 132 wanted, capped
    assert pa.attention_splits(1, 8, torch.device("cpu")) == 1
    monkeypatch.setattr(pa, "SPLITS_OVERRIDE", 1)
    assert pa.attention_splits(1, 8, gpu) == 1


def test_launch_without_config_takes_the_chosen_splits(device, monkeypatch):
    """With no config the launch splits as attention_splits says (here forced to 3 by the override), merging once:
    the default block sizes must not pin the one-pass kernel."""
    from manylora.kernels import paged_attention as pa

    launched = []
    real = pa.relauncher

    def spy(fn, **meta):
        launched.append((fn.__name__, meta.get("SPLITS")))
        return real(fn, **meta)

    monkeypatch.setattr(pa, "relauncher", spy)
    case = make_case(seed_of("auto_splits"), [200, 3, 0], 2, 4, 32, 16)
    for override, expected_launches in ((3, [("_paged_decode_attention_kernel", 3),
                                             ("_paged_attention_merge_kernel", 3)]),
                                        (1, [("_paged_decode_attention_kernel", 1)])):
        monkeypatch.setattr(pa, "SPLITS_OVERRIDE", override)
        launched.clear()
        out, expected = run_both(case, device)
        torch.testing.assert_close(out, expected, **TOL)
        assert launched == expected_launches
