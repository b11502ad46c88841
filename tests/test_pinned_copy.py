"""PinnedStager: host-to-device copies through pinned buffers (CUDA only; the H200 runs these)."""

import pytest
import torch

from manylora.engine.memory.pinned_copy import PinnedStager

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging needs a CUDA device")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
@pytest.mark.parametrize("numel", [1, 1000, 4096 * 3 + 17])
def test_copy_matches_source_across_chunks(dtype, numel):
    gen = torch.Generator().manual_seed(numel)
    src = (torch.randn(numel, generator=gen) * 1000).to(dtype)
    stager = PinnedStager(chunk_bytes=4096)  # many chunks, both buffers reused
    stream = torch.cuda.Stream()
    for _ in range(2):  # a second copy reuses buffers whose DMAs may still run
        dst = torch.full((numel,), -1, dtype=dtype, device="cuda")
        stager.copy(src, dst, stream)
        stream.synchronize()
        assert torch.equal(dst.cpu(), src)


def test_copy_refuses_mismatched_tensors():
    stager = PinnedStager(chunk_bytes=1024)
    stream = torch.cuda.Stream()
    with pytest.raises(ValueError, match="does not match"):
        stager.copy(torch.zeros(10), torch.zeros(11, device="cuda"), stream)
    with pytest.raises(ValueError, match="contiguous"):
        stager.copy(torch.zeros(10, 2).t(), torch.zeros(20, device="cuda"), stream)
