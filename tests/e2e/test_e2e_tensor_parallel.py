"""One generator instance driving two tensor-parallel ranks (gloo on the CPU) behind the real server."""

from __future__ import annotations

import pytest
from test_e2e_oracle import check_mixed_batches, peft_reference

pytestmark = pytest.mark.e2e


def test_tensor_parallel_generator_matches_peft_in_mixed_batches(model_dir, tmp_path, make_server, tokenizer):
    srv = make_server(model_dir, tmp_path / "server", params={"tensor_parallel_size": "2"})
    try:
        client = srv.client()
        assert client.stats()["tensor_parallel_size"] == 2
        # rank 0's every step waits on rank 1 in the all-reduces: these outputs came from both ranks
        check_mixed_batches(client, tokenizer, peft_reference(srv, tokenizer), srv.catalogue)
    finally:
        srv.stop()
