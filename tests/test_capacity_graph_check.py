"""perf/capacity/graph_check.py: a capacity run says when the engine it measured (in-process, or the server's, read
through its stats) runs mixed steps eagerly that its configuration asked to replay from CUDA graphs."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import perf.capacity.serving as serving
from manylora.engine.config import EngineConfig
from perf.capacity.graph_check import graph_warnings
from perf.engine.checkpoint import SHAPES, write_base


def test_a_run_warns_when_its_engine_s_mixed_steps_were_not_captured():
    """A capacity run of an engine (in-process or in the server) whose mixed-step graphs ran out of memory measures a
    slower engine than the one configured: the results say so (all of them eager, or only some buckets captured);
    where the configuration has no mixed-step graphs, nothing is said."""
    def warn(captured, device="cuda", moe=False, **knobs):
        return graph_warnings(EngineConfig(model_dir="unused", max_num_batched_tokens=1024, **knobs), device, moe,
                              captured)

    every = list(range(64, 1025, 64))
    assert warn(every) == []
    assert "run eagerly" in warn([])[0]
    assert "for 9 of 16 token buckets" in warn([64, 128, 192, 256, 384, 512, 768, 960, 1024])[0]
    assert warn([64, 1024], mixed_step_buckets="64,1024") == []
    assert "for 1 of 2" in warn([1024], mixed_step_buckets="64,1024")[0]
    for quiet in (warn([], device="cpu"), warn([], mixed_step_graphs=False), warn([], cuda_graphs=False),
                  warn([], moe=True), warn([], tensor_parallel_size=2)):
        assert quiet == []


def test_the_server_part_reads_its_engine_s_captured_buckets_from_stats(tmp_path, monkeypatch):
    """The server's engine is checked through its ``stats`` with the parameters the server was given; a server
    whose stats cannot be read is a warning too, and a CPU server is not asked."""
    base = write_base(tmp_path / "base", SHAPES["tiny"], dtype=torch.float32)
    part = serving.ServerPart(SimpleNamespace(cfg=None, ckpt=SimpleNamespace(base_dir=str(base))))
    server = SimpleNamespace(grpc_url="127.0.0.1:1", http_url="127.0.0.1:2")
    replies: list = []

    class FakeClient:
        def __init__(self, grpc_url, http_url, timeout):
            assert (grpc_url, http_url) == (server.grpc_url, server.http_url)

        def stats(self):
            reply = replies.pop(0)
            if isinstance(reply, Exception):
                raise reply
            return reply

    monkeypatch.setattr(serving, "ManyLoraClient", FakeClient)
    params = {"max_num_batched_tokens": "512", "max_num_seqs": "8", "device": "cuda"}
    replies[:] = [{"mixed_step_buckets": [64, 128, 192, 256, 320, 384, 448, 512]}, {"mixed_step_buckets": []},
                  OSError("connection refused")]
    assert part._graph_warnings(server, params) == []
    assert "run eagerly" in part._graph_warnings(server, params)[0]
    assert "could not be read (connection refused)" in part._graph_warnings(server, params)[0]
    assert part._graph_warnings(server, {**params, "device": "cpu"}) == [] and not replies
