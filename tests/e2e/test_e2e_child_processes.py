"""The generator's child processes behind the real server: two tensor-parallel ranks (gloo on the CPU),
and adapter loader processes (the default on CUDA). Both are spawned from inside Triton's Python stub."""

from __future__ import annotations

import pytest
from test_e2e_oracle import check_mixed_batches, peft_reference

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("params, stat", [
    ({"tensor_parallel_size": "2"}, "tensor_parallel_size"),
    ({"adapter_load_processes": "2"}, "adapter_load_processes"),
])
def test_child_processes_serve_what_peft_computes(params, stat, model_dir, tmp_path, make_server, tokenizer):
    srv = make_server(model_dir, tmp_path / "server", params=params)
    try:
        client = srv.client()
        # tensor parallelism: rank 0's every step waits on rank 1 in the all-reduces, so these outputs
        # came from both ranks; loader processes: every adapter was read and packed in a child
        check_mixed_batches(client, tokenizer, peft_reference(srv, tokenizer), srv.catalogue)
        stats = client.stats()
    finally:
        srv.stop()
    assert stats[stat] == 2, stats
    assert stats["host_loads"] == len(srv.catalogue), stats
