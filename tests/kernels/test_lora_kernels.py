"""LoRA shrink/expand kernels (BGMV and SGMV forms) against the torch references.

Every case draws fresh random data from its own seed: dense adapter matrices are written rank
row by rank row into a flat pool at shuffled, gapped offsets (the gaps hold random values too).
Outputs the kernels write are poisoned with NaN first. ``lora_shrink`` overwrites its whole
output (rows of base-only tokens, slot -1, come back zero); ``lora_expand`` must leave the rows
of base-only tokens bit-identical.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest does it too)

import pytest  # noqa: E402
import torch  # noqa: E402
from lora_cases import (  # noqa: E402
    DISTS,
    TOL,
    LoraCase,
    dense_lora,
    make_case,
    poisoned,
    seed_of,
)

from manylora.kernels.lora_expand import lora_expand  # noqa: E402
from manylora.kernels.lora_meta import build_segments, build_segments_on_device  # noqa: E402
from manylora.kernels.lora_shrink import lora_shrink  # noqa: E402
from manylora.kernels.reference import ref_lora_expand, ref_lora_shrink  # noqa: E402


def expected_shrink(case: LoraCase) -> torch.Tensor:
    """The reference shrink output; rows of base-only tokens are zero, as ``lora_shrink`` leaves them."""
    ns = case.a_row_offsets.shape[0]
    expected = torch.zeros(ns, case.x.shape[0], case.a_row_offsets.shape[2])
    return ref_lora_shrink(
        case.x.cpu(), case.pool.cpu(), case.a_row_offsets.cpu(), case.ranks.cpu(), case.token_slots.cpu(), expected
    )


def segments_for(case: LoraCase, segmented: bool | str):
    """No segments (BGMV), host-built ones (True), or tables built on the device with fixed shapes ("device", what a
    CUDA-graph decode step captures)."""
    if segmented == "device":
        return build_segments_on_device(case.token_slots, case.a_row_offsets.shape[1])
    return build_segments(case.token_slots) if segmented else None


def check_shrink(case: LoraCase, device: str, segmented: bool | str, config=None) -> torch.Tensor:
    ns = case.a_row_offsets.shape[0]
    num_tokens, max_rank = case.x.shape[0], case.a_row_offsets.shape[2]
    expected = expected_shrink(case)
    out = poisoned((ns, num_tokens, max_rank), device)
    segments = segments_for(case, segmented)
    args = (case.x, case.pool, case.a_row_offsets, case.ranks, case.token_slots)
    if ns == 1:  # exercise the 2-D single-slice form too
        args = (case.x, case.pool, case.a_row_offsets[0], case.ranks[0], case.token_slots)
        lora_shrink(*args, out[0], segments=segments, config=config)
    else:
        lora_shrink(*args, out, segments=segments, config=config)
    out = out.cpu()
    assert not out.isnan().any(), "the whole output must be written"
    torch.testing.assert_close(out, expected, **TOL)
    active = case.token_slots.cpu() >= 0
    assert (out[:, ~active] == 0).all(), "rows of base-only tokens must be zero"
    return out


def check_expand(case: LoraCase, device: str, segmented: bool | str, config=None) -> None:
    ns = case.a_row_offsets.shape[0]
    num_tokens, max_rank = case.x.shape[0], case.a_row_offsets.shape[2]
    slots = case.token_slots.cpu().long()
    # y: random inside each token's rank, NaN past it and on base-only rows (must not be read)
    y = torch.randn(ns, num_tokens, max_rank, generator=case.gen)
    rank_of_token = torch.where(slots >= 0, case.ranks.cpu()[:, slots.clamp(min=0)].long(), 0)  # [NS, T]
    y[torch.arange(max_rank)[None, None, :] >= rank_of_token[:, :, None]] = float("nan")
    base = 10.0 * torch.randn(num_tokens, case.slice_bounds[-1], generator=case.gen)
    expected = base.clone()
    ref_lora_expand(
        y, case.pool.cpu(), case.b_row_offsets.cpu(), case.ranks.cpu(), case.scalings.cpu(),
        case.token_slots.cpu(), expected, case.slice_bounds,
    )  # fmt: skip
    out = base.to(device, copy=True)
    segments = segments_for(case, segmented)
    if ns == 1:
        lora_expand(
            y[0].to(device), case.pool, case.b_row_offsets[0], case.ranks[0], case.scalings[0],
            case.token_slots, out, None, segments=segments, config=config,
        )  # fmt: skip
    else:
        lora_expand(
            y.to(device), case.pool, case.b_row_offsets, case.ranks, case.scalings,
            case.token_slots, out, case.slice_bounds, segments=segments, config=config,
        )  # fmt: skip
    out = out.cpu()
    torch.testing.assert_close(out, expected, **TOL)
    inactive = slots < 0
    assert torch.equal(out[inactive], base[inactive]), "rows of base-only tokens must stay untouched"


def check_expand_overwrite(case: LoraCase, device: str, config=None) -> None:
    """The BGMV expand's overwrite form into an fp32 buffer of NaN: every element written, the LoRA term alone (the
    reference expanded into zeros), rows of base-only tokens exactly zero; and base + that term is the in-place
    expand's result (what the deferred expand's consumers rely on)."""
    ns = case.a_row_offsets.shape[0]
    num_tokens, max_rank = case.x.shape[0], case.a_row_offsets.shape[2]
    slots = case.token_slots.cpu().long()
    y = torch.randn(ns, num_tokens, max_rank, generator=case.gen)
    rank_of_token = torch.where(slots >= 0, case.ranks.cpu()[:, slots.clamp(min=0)].long(), 0)
    y[torch.arange(max_rank)[None, None, :] >= rank_of_token[:, :, None]] = float("nan")
    width = case.slice_bounds[-1]
    expected = torch.zeros(num_tokens, width)
    ref_lora_expand(y, case.pool.cpu(), case.b_row_offsets.cpu(), case.ranks.cpu(), case.scalings.cpu(),
                    case.token_slots.cpu(), expected, case.slice_bounds)  # fmt: skip
    term = poisoned((num_tokens, width), device)
    args = (case.pool, case.b_row_offsets, case.ranks, case.scalings, case.token_slots)
    lora_expand(y.to(device), *args, term, case.slice_bounds, config=config, overwrite=True)
    term = term.cpu()
    assert not term.isnan().any(), "the overwrite form must write every element of the slices"
    torch.testing.assert_close(term, expected, **TOL)
    assert (term[slots < 0] == 0).all(), "a base-only token's LoRA term must be zero"
    base = 10.0 * torch.randn(num_tokens, width, generator=case.gen)
    in_place = base.to(device, copy=True)
    lora_expand(y.to(device), *args, in_place, case.slice_bounds, config=config)
    torch.testing.assert_close(base + term, in_place.cpu(), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dist", DISTS)
@pytest.mark.parametrize("config", ["heuristic", "rows", "tile"])
def test_expand_overwrite(device, dist, config):
    cfg = {"heuristic": None, "rows": ROWS_CONFIG, "tile": TILE_CONFIG}[config]
    case = make_case(seed_of("overwrite", dist, config), 19, 72, [40, 24, 16], dist, device, align=4)
    check_expand_overwrite(case, device, cfg)


@pytest.mark.parametrize("cols", ["aligned", "odd"])
def test_expand_overwrite_mixed_ranks(device, cols):
    """Rank chunks partly past a slot's rank, slices on 16 bytes or of odd widths (the row-at-a-time fallback)."""
    widths = [48, 24, 40] if cols == "aligned" else [45, 21, 37]
    case = make_case(seed_of("overwrite_rows", cols), 23, 72, widths, "some_none", device, max_rank=32,
                     rank_choices=(1, 3, 4, 16, 21, 32), align=4)  # fmt: skip
    for config in ({"ROWS": True, "BLOCK_R": 4, "BLOCK_N": 32, "num_warps": 1}, TILE_CONFIG):
        check_expand_overwrite(case, device, config)


# ---------------------------------------------------------------------------------------------
# the grid
# ---------------------------------------------------------------------------------------------

ROWS_CONFIG = {"ROWS": True, "BLOCK_R": 16, "BLOCK_N": 64, "num_warps": 1}
TILE_CONFIG = {"ROWS": False, "BLOCK_R": 16, "BLOCK_N": 64, "num_warps": 4}

GRID = [
    (t, inf, dist, ns)
    for t in (1, 3, 17, 64)
    for inf in (64, 72, 130)
    for dist in DISTS
    for ns in (1, 3)
    # keep the interpreter run short: the largest T only with the widest input (two K splits)
    if not (t == 64 and inf != 130)
]


@pytest.mark.parametrize(("num_tokens", "in_features", "dist", "num_slices"), GRID)
def test_shrink_expand_grid(device, num_tokens, in_features, dist, num_slices):
    widths = [in_features + 8, 24, 40][:num_slices]  # q/k/v-like slices of different widths
    case = make_case(seed_of("grid", num_tokens, in_features, dist, num_slices), num_tokens, in_features,
                     widths, dist, device)  # fmt: skip
    for segmented in (False, True, "device"):
        check_shrink(case, device, segmented)
        check_expand(case, device, segmented)
    # the heuristic gives these small launches the BGMV expand's tile body: the row-streaming body too
    check_expand(case, device, False, config=ROWS_CONFIG)


@pytest.mark.parametrize("num_tokens", [128, 256])
def test_device_segments_at_cuda_graph_sizes(device, num_tokens):
    """What a CUDA-graph decode step of the segmented forms launches: a bucket of 128 / 256 tokens, a slot table of as
    many entries of which few are in use, and a random share of base-only tokens (the padding); fresh random
    groupings against the reference, and under the interpreter every access checked against its tensor (the forms'
    illegal memory access on the H200 is not found yet; this is where it was looked for on the CPU)."""
    gen = torch.Generator().manual_seed(num_tokens)
    for trial in range(3):
        case = make_case(seed_of("graph-size", num_tokens, trial), num_tokens, 16, [16, 24], "distinct", device)
        used = int(torch.randint(1, 41, (1,), generator=gen))
        base_only = torch.rand(num_tokens, generator=gen) < (0.1, 0.5, 0.9)[trial]
        slots = torch.where(base_only, -1, torch.randint(0, used, (num_tokens,), generator=gen))
        case.token_slots = slots.to(torch.int32).to(device)
        check_shrink(case, device, "device")
        check_expand(case, device, "device")


@pytest.mark.parametrize("dist", ["powerlaw", "some_none", "distinct"])
def test_reference_matches_dense(dist):
    """The references against plain dense matmuls of the matrices written into the pool."""
    case = make_case(seed_of("dense", dist), 17, 72, [80, 24, 40], dist, "cpu")
    shrink_ref = poisoned((3, 17, 16), "cpu")
    ref_lora_shrink(case.x, case.pool, case.a_row_offsets, case.ranks, case.token_slots, shrink_ref)
    shrink, delta = dense_lora(case)
    active = case.token_slots >= 0
    torch.testing.assert_close(shrink_ref[:, active], shrink[:, active], **TOL)
    base = torch.randn(17, 144, generator=case.gen)
    out = base.clone()
    ref_lora_expand(shrink_ref, case.pool, case.b_row_offsets, case.ranks, case.scalings, case.token_slots, out,
                    case.slice_bounds)  # fmt: skip
    torch.testing.assert_close(out, base + delta, **TOL)


@pytest.mark.parametrize("segmented", [False, True])
def test_chain_matches_dense(device, segmented):
    """shrink -> expand (the kernels) equals x @ A^T @ B^T * scaling from the dense matrices."""
    case = make_case(seed_of("chain", segmented), 17, 130, [96, 32, 32], "some_none", device)
    shrink = poisoned((3, 17, 16), device)
    segments = build_segments(case.token_slots) if segmented else None
    lora_shrink(case.x, case.pool, case.a_row_offsets, case.ranks, case.token_slots, shrink, segments=segments)
    base = torch.randn(17, 160, generator=case.gen)
    out = base.to(device, copy=True)
    lora_expand(shrink, case.pool, case.b_row_offsets, case.ranks, case.scalings, case.token_slots, out,
                case.slice_bounds, segments=segments)  # fmt: skip
    _, delta = dense_lora(case)
    torch.testing.assert_close(out.cpu(), base + delta, **TOL)


@pytest.mark.parametrize("segmented", [False, True])
def test_prepared_launch_serves_every_layer(device, segmented):
    """A launch prepared once (as a step does for its first layer) and launched for other layers' tensors (fresh
    inputs, other views of the tables, other outputs) gives each layer its own result. Compiled, launches after the
    first with the same argument signature skip Triton's dispatch (manylora/kernels/relaunch.py): they must still
    launch the
    right kernel."""
    from manylora.kernels.lora_expand import prepare_expand
    from manylora.kernels.lora_shrink import prepare_shrink

    case = make_case(seed_of("prepared", segmented), 23, 136, [96, 32, 32], "some_none", device)
    layers = 4
    a_tables = case.a_row_offsets.unsqueeze(0).repeat(layers, 1, 1, 1)  # every layer's view: a distinct tensor
    b_tables = case.b_row_offsets.unsqueeze(0).repeat(layers, 1, 1, 1)
    ranks = case.ranks.unsqueeze(0).repeat(layers, 1, 1)
    scalings = case.scalings.unsqueeze(0).repeat(layers, 1, 1)
    segments = build_segments(case.token_slots) if segmented else None
    xs = [torch.randn(case.x.shape, generator=case.gen).to(device) for _ in range(layers)]
    ys = [poisoned((3, 23, 16), device) for _ in range(layers)]
    bases = [torch.randn(23, 160, generator=case.gen) for _ in range(layers)]
    outs = [b.to(device, copy=True) for b in bases]
    shrink = prepare_shrink(xs[0], case.pool, a_tables[0], ranks[0], case.token_slots, ys[0], segments=segments)
    expand = prepare_expand(ys[0], case.pool, b_tables[0], ranks[0], scalings[0], case.token_slots, outs[0],
                            case.slice_bounds, segments=segments)  # fmt: skip
    for layer in range(layers):
        shrink.launch(xs[layer], case.pool, a_tables[layer], ranks[layer], case.token_slots, ys[layer])
        expand.launch(ys[layer], case.pool, b_tables[layer], ranks[layer], scalings[layer], case.token_slots,
                      outs[layer])  # fmt: skip
    for layer in range(layers):
        case.x = xs[layer]
        _, delta = dense_lora(case)
        torch.testing.assert_close(outs[layer].cpu(), bases[layer] + delta, **TOL)
    if device == "cuda":  # a layer whose tensors align differently dispatches once more (ranks[1] is 8 bytes off)
        assert shrink.relaunch.direct_launches >= layers // 2
        assert expand.relaunch.direct_launches >= layers // 2


SMALL_BLOCKS = [
    # BGMV: several rank blocks per token (blocks past a slot's rank write zeros / are skipped)
    ({"BLOCK_R": 4, "BLOCK_K": 32}, {"BLOCK_R": 4, "BLOCK_N": 32}, False),
    # SGMV: several row blocks per segment, several rank blocks (R_max = 32), several K/N blocks
    ({"BLOCK_M": 16, "BLOCK_R": 16, "BLOCK_K": 16}, {"BLOCK_M": 16, "BLOCK_R": 16, "BLOCK_N": 16}, True),
    # split-K: 72 = 2.25 K blocks of 32, in 3 splits (the last one short and masked)
    ({"BLOCK_R": 16, "BLOCK_K": 32, "SPLIT_K": 3}, {"BLOCK_R": 16, "BLOCK_N": 64}, False),
    ({"BLOCK_M": 16, "BLOCK_R": 16, "BLOCK_K": 16, "SPLIT_K": 3}, {"BLOCK_M": 16, "BLOCK_R": 16, "BLOCK_N": 32}, True),
]
SMALL_BLOCK_CASES = [
    (*blocks, dist) for i, blocks in enumerate(SMALL_BLOCKS) for dist in ("one", "some_none") if i < 2 or dist != "one"
]


@pytest.mark.parametrize(("shrink_cfg", "expand_cfg", "segmented", "dist"), SMALL_BLOCK_CASES)
def test_small_blocks(device, shrink_cfg, expand_cfg, segmented, dist):
    case = make_case(seed_of("small", segmented, dist), 40, 72, [48, 20, 36], dist, device, max_rank=32,
                     rank_choices=(1, 4, 8, 16, 32))  # fmt: skip
    check_shrink(case, device, segmented, config=shrink_cfg)
    check_expand(case, device, segmented, config=expand_cfg)


@pytest.mark.parametrize(
    ("num_tokens", "in_features", "num_slices", "max_rank"),
    [(1, 4096, 3, 16), (16, 4096, 3, 16), (64, 4096, 3, 8), (16, 14336, 1, 64), (256, 4096, 2, 16)],
)
def test_shrink_config_decode(num_tokens, in_features, num_slices, max_rank):
    """Decode shapes: enough programs to fill the GPU, K tiles of 128..512, splits that divide K evenly."""
    from manylora.kernels.lora_config import NUM_SMS, shrink_config

    cfg = shrink_config(num_tokens, in_features, max_rank, segmented=False, num_slices=num_slices)
    assert 128 <= cfg["BLOCK_K"] <= 512
    num_k_blocks = -(-in_features // cfg["BLOCK_K"])
    assert num_k_blocks % cfg["SPLIT_K"] == 0
    programs = num_tokens * num_slices * -(-max_rank // cfg["BLOCK_R"]) * cfg["SPLIT_K"]
    assert programs >= 2 * NUM_SMS or cfg["SPLIT_K"] == num_k_blocks


@pytest.mark.parametrize(("max_out", "num_slices"), [(4096, 3), (4096, 1), (14336, 2)])
def test_expand_config_decode(max_out, num_slices):
    """The BGMV expand's heuristic at the Llama-3-8B projections: the tile body for launches of at most 131,072
    output elements, the row body above with 16-byte-wide rows per thread (BLOCK_N a multiple of 256 a warp), and a
    handful of variants over every token count a step can have (each variant is one compile, not one per size)."""
    from manylora.kernels.lora_config import expand_config

    variants = set()
    for num_tokens in range(1, 4097):
        cfg = expand_config(num_tokens, max_out, 16, segmented=False, num_slices=num_slices)
        assert cfg["ROWS"] == (num_tokens * num_slices * max_out > 131072), (num_tokens, cfg)
        if cfg["ROWS"]:
            assert cfg["BLOCK_R"] == 16 and cfg["BLOCK_N"] == 256 * cfg["num_warps"], cfg
        variants.add(tuple(sorted(cfg.items())))
    assert len(variants) <= 4, variants


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_aligned_rows(device, dtype):
    """Rows on 16-byte boundaries take the kernels' vectorised branch; same results."""
    case = make_case(seed_of("aligned", str(dtype)), 17, 72, [40, 24], "some_none", device, dtype=dtype,
                     align=16 // dtype.itemsize)  # fmt: skip
    assert (case.a_row_offsets[case.a_row_offsets >= 0] % (16 // dtype.itemsize) == 0).all()
    for segmented in (False, True):
        shrink = check_shrink(case, device, segmented) if dtype == torch.float32 else None
        if shrink is None:
            shrink = poisoned((2, 17, 16), device)
            segments = build_segments(case.token_slots) if segmented else None
            lora_shrink(case.x, case.pool, case.a_row_offsets, case.ranks, case.token_slots, shrink, segments=segments)
            torch.testing.assert_close(shrink.cpu(), expected_shrink(case), rtol=1e-3, atol=1e-3)
        if dtype == torch.float32:
            check_expand(case, device, segmented)


@pytest.mark.parametrize("cols", ["aligned", "odd"])
def test_expand_rows_aligned_mixed_ranks(device, cols):
    """The BGMV expand's row-streaming body over several rank chunks: rows on 16 bytes, ranks 1..32 in chunks of 4
    (a slot's last chunk partly past its rank), slices on 16 bytes (the unrolled 16-byte path) or of odd widths (the
    row-at-a-time fallback); the tile body and the heuristic's choice on the same case."""
    widths = [48, 24, 40] if cols == "aligned" else [45, 21, 37]
    case = make_case(seed_of("rows", cols), 23, 72, widths, "powerlaw", device, max_rank=32,
                     rank_choices=(1, 3, 4, 16, 21, 32), align=4)  # fmt: skip
    for config in ({"ROWS": True, "BLOCK_R": 4, "BLOCK_N": 32, "num_warps": 1}, TILE_CONFIG, None):
        check_expand(case, device, False, config=config)


def test_strided_views(device):
    """x a column slice of a wider tensor; base_out a column window of a fused output."""
    case = make_case(seed_of("strided"), 17, 72, [40, 24], "powerlaw", device)
    wide = torch.randn(17, 200, generator=case.gen).to(device)
    wide[:, 50:122] = case.x
    x_view = wide[:, 50:122]
    for segmented in (False, True):
        segments = build_segments(case.token_slots) if segmented else None
        shrink = poisoned((2, 17, 16), device)
        lora_shrink(x_view, case.pool, case.a_row_offsets, case.ranks, case.token_slots, shrink, segments=segments)
        expected = expected_shrink(case)
        torch.testing.assert_close(shrink.cpu(), expected, **TOL)

        fused = torch.randn(17, 100, generator=case.gen)
        expected_fused = fused.clone()
        ref_lora_expand(expected, case.pool.cpu(), case.b_row_offsets.cpu(), case.ranks.cpu(), case.scalings.cpu(),
                        case.token_slots.cpu(), expected_fused[:, 30:94], [0, 40, 64])  # fmt: skip
        out = fused.to(device, copy=True)
        lora_expand(shrink, case.pool, case.b_row_offsets, case.ranks, case.scalings, case.token_slots,
                    out[:, 30:94], [0, 40], segments=segments)  # fmt: skip
        torch.testing.assert_close(out.cpu(), expected_fused, **TOL)
        assert torch.equal(out.cpu()[:, :30], fused[:, :30]) and torch.equal(out.cpu()[:, 94:], fused[:, 94:])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(device, dtype):
    case = make_case(seed_of("half", str(dtype)), 17, 72, [40, 24], "some_none", device, dtype=dtype)
    for segmented in (False, True):
        if segmented and dtype == torch.bfloat16 and device == "cpu":
            continue  # triton's interpreter computes bf16 tl.dot wrongly (triton 3.9); checked on GPU only
        segments = build_segments(case.token_slots) if segmented else None
        shrink = poisoned((2, 17, 16), device)
        lora_shrink(case.x, case.pool, case.a_row_offsets, case.ranks, case.token_slots, shrink, segments=segments)
        expected = expected_shrink(case)
        torch.testing.assert_close(shrink.cpu(), expected, rtol=1e-3, atol=1e-3)

        base = torch.randn(17, 64, generator=case.gen).to(dtype)
        out = base.to(device, copy=True)
        lora_expand(expected.to(device), case.pool, case.b_row_offsets, case.ranks, case.scalings, case.token_slots,
                    out, case.slice_bounds, segments=segments)  # fmt: skip
        ref = ref_lora_expand(
            expected,
            case.pool.cpu(),
            case.b_row_offsets.cpu(),
            case.ranks.cpu(),
            case.scalings.cpu(),
            case.token_slots.cpu(),
            base.clone(),
            case.slice_bounds,
        )
        # the SGMV form rounds y to the pool dtype before its tl.dot
        torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=2e-2, atol=5e-2)


def test_empty_batch(device):
    case = make_case(seed_of("empty"), 3, 64, [32], "powerlaw", device)
    x = case.x[:0]
    out = poisoned((1, 0, 16), device)
    lora_shrink(x, case.pool, case.a_row_offsets, case.ranks, case.token_slots[:0], out)
    lora_shrink(x, case.pool, case.a_row_offsets, case.ranks, case.token_slots[:0], out,
                segments=build_segments(case.token_slots[:0]))  # fmt: skip
    base = torch.zeros(0, 32, device=device)
    lora_expand(out, case.pool, case.b_row_offsets, case.ranks, case.scalings, case.token_slots[:0], base, [0, 32])


def test_expand_overwrite_with_nothing_to_launch_zeroes_its_slices(device):
    """The overwrite form where no adapter slot exists (or no rank) launches nothing, yet its output is the LoRA term:
    zero in the slices' columns, the columns outside them untouched."""
    y = torch.zeros((1, 5, 0), dtype=torch.float32, device=device)  # max_rank 0
    pool = torch.zeros(16, device=device)
    out = torch.full((5, 12), float("nan"), device=device)
    lora_expand(y, pool, torch.zeros((1, 2, 0), dtype=torch.int64, device=device),
                torch.ones((1, 2), dtype=torch.int32, device=device), torch.ones((1, 2), device=device),
                torch.zeros(5, dtype=torch.int32, device=device), out, [2, 10], overwrite=True)  # fmt: skip
    out = out.cpu()
    assert (out[:, 2:10] == 0).all() and out[:, :2].isnan().all() and out[:, 10:].isnan().all()


# ---------------------------------------------------------------------------------------------
# metadata and argument checks
# ---------------------------------------------------------------------------------------------


def test_argument_errors(device):
    case = make_case(seed_of("errors"), 3, 64, [32], "powerlaw", device)
    out = poisoned((1, 3, 16), device)
    args = (case.x, case.pool, case.a_row_offsets, case.ranks, case.token_slots)
    with pytest.raises(TypeError, match="out"):
        lora_shrink(*args, out.double())
    with pytest.raises(TypeError, match="pool"):
        lora_shrink(case.x, case.pool.half(), *args[2:], out)
    with pytest.raises(TypeError, match="token_slots"):
        lora_shrink(*args[:4], case.token_slots.long(), out)
    with pytest.raises(ValueError, match="out"):
        lora_shrink(*args, out[:, :2])
    with pytest.raises(ValueError, match="segments"):
        lora_shrink(*args, out, segments=build_segments(case.token_slots[:2]))
    base = torch.zeros(3, 32, device=device)
    with pytest.raises(ValueError, match="slice_offsets"):
        lora_expand(out, case.pool, case.b_row_offsets, case.ranks, case.scalings, case.token_slots, base, [0, 16, 32])
    with pytest.raises(TypeError, match="scalings"):
        lora_expand(out, case.pool, case.b_row_offsets, case.ranks, case.scalings.double(), case.token_slots, base)
    with pytest.raises(ValueError, match="overwrite form is BGMV only"):
        lora_expand(out, case.pool, case.b_row_offsets, case.ranks, case.scalings, case.token_slots, base,
                    segments=build_segments(case.token_slots), overwrite=True)
