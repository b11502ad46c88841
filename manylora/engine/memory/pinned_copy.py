"""Host-to-device copies of large pageable tensors through pinned staging buffers of our own.

A copy from pageable host memory (an adapter's pages, mapped from shared memory) goes through the
CUDA driver's staging buffer: the calling thread waits for it, and so does every other thread's
pageable copy, however small. On the H200, while adapters were being copied in on the copy thread,
the engine thread's small copies of step inputs (block tables, token slots: ``torch.tensor(...,
device=...)``) took about 1 ms each instead of tens of microseconds (``perf.engine.profile_engine
--python-profile`` at n = 2000 adapters: 1,526 ``Tensor.to`` calls, 2.0 s). Staging through pinned
buffers leaves the driver's path to the engine thread: this thread copies a chunk into a pinned
buffer (a CPU memcpy), and the DMA from it to the device runs asynchronously on the copy stream
while the next chunk is staged into the other buffer.
"""

from __future__ import annotations

import torch

CHUNK_BYTES = 8 << 20  # per pinned buffer: large enough for full-speed DMA, small enough to overlap


class PinnedStager:
    """Double-buffered pinned staging for ``copy``; one per copying thread (the buffers are reused)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, buffers: int = 2) -> None:
        if chunk_bytes <= 0 or buffers < 1:
            raise ValueError(f"PinnedStager needs chunk_bytes > 0 and buffers >= 1, got {chunk_bytes}, {buffers}")
        self.chunk_bytes = chunk_bytes
        self._buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(buffers)]
        self._in_flight: list[torch.cuda.Event | None] = [None] * buffers

    def copy(self, src: torch.Tensor, dst: torch.Tensor, stream: torch.cuda.Stream) -> torch.Tensor:
        """dst = src: src contiguous in host memory, dst contiguous on a CUDA device, same dtype and number of
        elements. The device-side copies are queued on ``stream``; returns ``dst`` once the last one is queued
        (later work on ``stream`` sees dst whole). Blocks only while both buffers are still being read."""
        if not src.is_contiguous() or not dst.is_contiguous():
            raise ValueError("PinnedStager.copy needs contiguous src and dst")
        if src.dtype != dst.dtype or src.numel() != dst.numel():
            raise ValueError(f"PinnedStager.copy: src {src.dtype} x {src.numel()} does not match dst {dst.dtype} x "
                             f"{dst.numel()}")
        src_bytes = src.reshape(-1).view(torch.uint8)
        dst_bytes = dst.reshape(-1).view(torch.uint8)
        total, at, which = src_bytes.numel(), 0, 0
        with torch.cuda.stream(stream):
            while at < total:
                n = min(self.chunk_bytes, total - at)
                buffer, pending = self._buffers[which], self._in_flight[which]
                if pending is not None:
                    pending.synchronize()  # the DMA still reading this buffer
                buffer[:n].copy_(src_bytes[at:at + n])
                dst_bytes[at:at + n].copy_(buffer[:n], non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
                self._in_flight[which] = done
                at += n
                which = (which + 1) % len(self._buffers)
        return dst
