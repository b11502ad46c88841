"""The fused rotary embedding + KV-cache write kernel against the model's torch ops (fresh random inputs)."""

from __future__ import annotations

import pytest
import torch

from manylora.kernels.reference import ref_rope_kv_write
from manylora.kernels.rope_kv import rope_kv_write


def bf16_steps(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> float:
    """Largest difference in units of the bf16 step (2^-7 relative) at ``scale``: the magnitude of the rotation's two
    products, since where they cancel the result is far smaller than either's rounding."""
    step = scale.float().abs().clamp(min=2.0**-100) * 2.0**-7
    return float(((got.float() - want.float()).abs() / step).max())


def _product_scale(qk, positions, cos, sin, weight, eps):
    """|x * cos| + |rotate_half(x) * sin| per element of the (normed) q and k heads, in fp32."""
    x = qk.float()
    if weight is not None:
        x = weight.float() * torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=eps)
    half = x.shape[-1] // 2
    partner = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x.abs() * cos[positions].float().abs()[:, None] + partner.abs() * sin[positions].float().abs()[:, None]


def _case(gen, dtype, tokens, num_q, num_kv, head_dim, num_pages, page_size, layers, max_len):
    """A q/k/v projection output with a wider row than its heads (a view, as in the model), random cos / sin tables,
    a KV cache full of random values, and distinct random slots for the tokens."""
    width = (num_q + 2 * num_kv) * head_dim
    qkv = torch.randn(tokens, width + 3, generator=gen).to(dtype)[:, 1 : width + 1]
    qk = qkv[:, : (num_q + num_kv) * head_dim].view(tokens, num_q + num_kv, head_dim)
    v = qkv[:, (num_q + num_kv) * head_dim :].view(tokens, num_kv, head_dim)
    cos = torch.randn(max_len, head_dim, generator=gen).to(dtype)
    sin = torch.randn(max_len, head_dim, generator=gen).to(dtype)
    kv = torch.randn(num_pages, layers, 2, page_size, num_kv, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:tokens].long()
    positions = torch.randint(0, max_len, (tokens,), generator=gen)
    return qkv, qk, v, cos, sin, kv, slots, positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("tokens, num_q, num_kv, head_dim", [
    (1, 1, 1, 2), (5, 4, 2, 8), (7, 3, 1, 24), (3, 6, 6, 10), (16, 32, 8, 128)])
def test_rope_kv_write_matches_reference(device, dtype, norm, tokens, num_q, num_kv, head_dim):
    gen = torch.Generator().manual_seed(tokens * 1000 + num_q * 100 + head_dim + norm)
    qkv, qk, v, cos, sin, kv, slots, positions = _case(gen, dtype, tokens, num_q, num_kv, head_dim,
                                                       num_pages=5, page_size=4, layers=3, max_len=40)
    weight = (1 + 0.3 * torch.randn(num_q + num_kv, head_dim, generator=gen)).to(dtype) if norm else None
    layer = int(torch.randint(0, 3, (1,), generator=gen))
    want_q, want_kv = ref_rope_kv_write(qk, v, positions, cos, sin, kv, layer, slots, num_q, weight, 1e-6)
    before = qkv.clone()

    qkv_d, kv_d = qkv.clone().to(device), kv.clone().to(device)  # (on the CPU .to would alias the originals)
    qk_d = qkv_d[:, : (num_q + num_kv) * head_dim].view(tokens, num_q + num_kv, head_dim)
    v_d = qkv_d[:, (num_q + num_kv) * head_dim :].view(tokens, num_kv, head_dim)
    got_q = rope_kv_write(qk_d, v_d, positions.to(device), cos.to(device), sin.to(device), kv_d, layer,
                          slots.to(device), num_q, None if weight is None else weight.to(device), 1e-6)
    assert got_q.data_ptr() == qkv_d.data_ptr() and got_q.shape == (tokens, num_q, head_dim)  # q, in place
    got_q, got_kv, qkv_after = got_q.cpu(), kv_d.cpu(), qkv_d.cpu()
    # the k and v columns of the projection are left as they were; the cache changes at the tokens' slots only
    torch.testing.assert_close(qkv_after[:, num_q * head_dim :], before[:, num_q * head_dim :], rtol=0, atol=0)
    page_size = kv.shape[3]
    written = torch.zeros(kv.shape[0], page_size, dtype=torch.bool)
    written[slots // page_size, slots % page_size] = True
    untouched = ~written[:, None, None, :].expand(-1, kv.shape[1], 2, -1).clone()
    untouched[:, [i for i in range(kv.shape[1]) if i != layer]] = True
    torch.testing.assert_close(got_kv[untouched], kv[untouched], rtol=0, atol=0)
    torch.testing.assert_close(got_kv[:, layer, 1], want_kv[:, layer, 1], rtol=0, atol=0)  # v: copied
    scale = _product_scale(qk, positions, cos, sin, weight, 1e-6)
    got_k = got_kv[:, layer, 0][slots // page_size, slots % page_size]
    want_k = want_kv[:, layer, 0][slots // page_size, slots % page_size]
    for got, want, at in ((got_q, want_q, scale[:, :num_q]), (got_k, want_k, scale[:, num_q:])):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        elif device != "cpu" and not norm:  # compiled: the torch ops' roundings
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        else:
            # with the norm, rsqrt's last bit moves the products by a step; Triton's interpreter rounds
            # fp32 -> bf16 toward zero, once per cast: products and sum, and the norm's two (a step of each)
            assert bf16_steps(got, want, at) <= (6 if norm else 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("tokens, num_q, num_kv, head_dim", [(5, 4, 2, 8), (16, 32, 8, 128)])
def test_rope_kv_write_adds_the_lora_term_first(device, dtype, norm, tokens, num_q, num_kv, head_dim):
    """A deferred LoRA term (fp32 [T, (NQ + 2 NKV) * D]) is added to q, k and v and rounded once, then the norm,
    the rotation and the cache write as without it: the reference on the projection output with the term added."""
    gen = torch.Generator().manual_seed(tokens * 31 + num_q * 7 + head_dim + norm)
    qkv, qk, v, cos, sin, kv, slots, positions = _case(gen, dtype, tokens, num_q, num_kv, head_dim,
                                                       num_pages=5, page_size=4, layers=3, max_len=40)
    term = torch.randn(tokens, qkv.shape[1], generator=gen)
    weight = (1 + 0.3 * torch.randn(num_q + num_kv, head_dim, generator=gen)).to(dtype) if norm else None
    layer = int(torch.randint(0, 3, (1,), generator=gen))
    with_term = (qkv.float() + term).to(dtype)
    split = (num_q + num_kv) * head_dim
    qk_t = with_term[:, :split].view(tokens, num_q + num_kv, head_dim)
    v_t = with_term[:, split:].view(tokens, num_kv, head_dim)
    want_q, want_kv = ref_rope_kv_write(qk_t.clone(), v_t, positions, cos, sin, kv.clone(), layer, slots, num_q,
                                        weight, 1e-6)  # fmt: skip

    qkv_d, kv_d = qkv.clone().to(device), kv.clone().to(device)
    qk_d = qkv_d[:, :split].view(tokens, num_q + num_kv, head_dim)
    v_d = qkv_d[:, split:].view(tokens, num_kv, head_dim)
    got_q = rope_kv_write(qk_d, v_d, positions.to(device), cos.to(device), sin.to(device), kv_d, layer,
                          slots.to(device), num_q, None if weight is None else weight.to(device), 1e-6,
                          lora_delta=term.to(device)).cpu()  # fmt: skip
    got_kv = kv_d.cpu()
    page, off = slots // kv.shape[3], slots % kv.shape[3]
    scale = _product_scale(qk_t, positions, cos, sin, weight, 1e-6)
    pairs = ((got_q, want_q, scale[:, :num_q]),
             (got_kv[page, layer, 0, off], want_kv[page, layer, 0, off], scale[:, num_q:]),
             (got_kv[page, layer, 1, off], want_kv[page, layer, 1, off], v_t))  # fmt: skip
    for got, want, at in pairs:
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        elif device != "cpu" and not norm:  # compiled: the torch ops' roundings, the add's too
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        else:  # as above, and one more interpreter cast (the add's)
            assert bf16_steps(got, want, at) <= (8 if norm else 5)
    assert not torch.allclose(got_kv[page, layer, 1, off].float(), v[...].float(), rtol=0.05, atol=0.05)
    with pytest.raises(ValueError, match="lora_delta must have shape"):
        rope_kv_write(qk_d, v_d, positions.to(device), cos.to(device), sin.to(device), kv_d, layer,
                      slots.to(device), num_q, lora_delta=term[:, 1:].to(device))  # fmt: skip


def test_rope_kv_write_bad_input(device):
    gen = torch.Generator().manual_seed(3)
    _, qk, v, cos, sin, kv, slots, positions = _case(gen, torch.float32, 4, 2, 1, 8, num_pages=2, page_size=4,
                                                     layers=2, max_len=16)
    args = [t.to(device) for t in (qk, v, positions, cos, sin, kv)]
    slots = slots.to(device)
    with pytest.raises(ValueError, match="layer 2 outside the KV cache's 2 layers"):
        rope_kv_write(*args, 2, slots, 2)
    with pytest.raises(ValueError, match="need num_q_heads"):
        rope_kv_write(*args, 0, slots, 3)
    with pytest.raises(TypeError, match="positions"):
        rope_kv_write(args[0], args[1], args[2].int(), *args[3:], 0, slots, 2)
    with pytest.raises(ValueError, match="cos must be"):
        rope_kv_write(args[0], args[1], args[2], args[3][:, :4], *args[4:], 0, slots, 2)
    empty = rope_kv_write(args[0][:0], args[1][:0], args[2][:0], *args[3:], 0, slots[:0], 2)
    assert empty.shape == (0, 2, 8)
