"""Adapters changing while serving: load, unload, replace, resolvers; never another tenant's weights."""

from __future__ import annotations

import os
import random
import shutil
import threading
import time

import pytest

from manylora.engine.config import EngineConfig
from manylora.engine.errors import ErrorCode, RequestError
from manylora.engine.requests.types import GenerationRequest, SamplingParams
from manylora.engine.scheduling.engine import Engine
from manylora.engine.scheduling.offline import generate
from model_factory import make_base, peft_greedy, write_random_adapter

FLIPS = 60
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_base(tmp_path_factory.mktemp("lifecycle") / "base", "llama", seed=17)


def test_runtime_updates_are_off_by_default(base, tmp_path, monkeypatch):
    monkeypatch.delenv("MANYLORA_ALLOW_RUNTIME_ADAPTERS", raising=False)
    engine = Engine(EngineConfig(model_dir=str(base)), start=False)
    path = write_random_adapter(tmp_path / "a", base, rank=2, targets=["q_proj"], seed=1)
    for call in (lambda: engine.load_adapter("a", str(path)), lambda: engine.unload_adapter("a")):
        with pytest.raises(RequestError) as err:
            call()
        assert err.value.code is ErrorCode.UNSUPPORTED and "MANYLORA_ALLOW_RUNTIME_ADAPTERS" in err.value.message
    engine.shutdown()


def test_replies_and_listings_leave_out_server_paths_by_default(base, tmp_path):
    path = write_random_adapter(tmp_path / "a", base, rank=2, targets=["q_proj"], seed=1)
    engine = Engine(EngineConfig(model_dir=str(base), allow_runtime_adapters=True), start=False)
    try:
        loaded = engine.load_adapter("a", str(path))
        listed = engine.list_adapters()
        unloaded = engine.unload_adapter("a")
    finally:
        engine.shutdown()
    assert set(loaded) == {"name", "status", "rank", "target_modules", "sha256", "layers"}, loaded
    assert loaded["status"] == "ready" and listed == [loaded] and unloaded == {**loaded, "status": "unloaded"}
    assert str(tmp_path) not in str([loaded, listed, unloaded])


def test_load_unload_replace_while_generating_never_mixes_versions(base, tmp_path):
    """Hammer: versions of one name flip while requests run; each output equals the oracle of
    the version its responses name (the sha256 in every output)."""
    v1 = write_random_adapter(tmp_path / "v1", base, rank=4, targets=ALL, seed=101)
    v2 = write_random_adapter(tmp_path / "v2", base, rank=8, targets=["q_proj", "v_proj", "down_proj"], seed=202)
    engine = Engine(EngineConfig(model_dir=str(base), allow_runtime_adapters=True, max_num_seqs=8))
    sha_dir = {engine.load_adapter("hot", str(v1))["sha256"]: v1}
    sha_dir[engine.load_adapter("hot", str(v2), replace=True)["sha256"]] = v2
    rng = random.Random(3)
    prompts = [[0] + [rng.randrange(2, 290) for _ in range(rng.randint(2, 9))] for _ in range(4)]

    def flipper():
        versions = [v1, v2]
        for _ in range(FLIPS):
            choice = rng.random()
            try:
                if choice < 0.2:
                    engine.unload_adapter("hot")
                elif choice < 0.4:
                    engine.load_adapter("hot", str(rng.choice(versions)))
                else:
                    engine.load_adapter("hot", str(rng.choice(versions)), replace=True)
            except RequestError as e:
                assert e.code in (ErrorCode.NOT_FOUND, ErrorCode.ALREADY_EXISTS), e
            time.sleep(0.003)

    thread = threading.Thread(target=flipper)
    thread.start()
    served = []
    try:
        round_ = 0
        while thread.is_alive() or round_ < 3:  # generate for as long as versions keep flipping
            reqs = [GenerationRequest(f"h{round_}-{i}", prompts[i % 4], "hot", SamplingParams(max_tokens=8))
                    for i in range(8)]
            served += list(zip(reqs, generate(engine, reqs), strict=True))
            round_ += 1
        thread.join()
        # However the flips and rounds interleaved on a slow machine, serve each version once more
        # so the oracle below checks both.
        for version in (v1, v2):
            engine.load_adapter("hot", str(version), replace=True)
            reqs = [GenerationRequest(f"tail-{version.name}-{i}", prompts[i], "hot", SamplingParams(max_tokens=8))
                    for i in range(4)]
            served += list(zip(reqs, generate(engine, reqs), strict=True))
    finally:
        thread.join()
        engine.shutdown()
    oracle: dict[tuple[str, int], list[int]] = {}
    checked = 0
    for req, res in served:
        if res.error is not None:
            assert res.error.code is ErrorCode.NOT_FOUND and "hot" in res.error.message
            continue
        shas = {c.adapter_sha256 for c in res.chunks}
        assert len(shas) == 1, "one request named two adapter versions"
        sha = shas.pop()
        key = (sha, prompts.index(req.prompt_ids))
        if key not in oracle:
            oracle[key] = peft_greedy(base, sha_dir[sha], req.prompt_ids, 8)
        assert res.token_ids == oracle[key], f"{req.request_id} served with the wrong weights"
        checked += 1
    assert checked >= 10
    assert len({k[0] for k in oracle}) == 2, "both versions should have served requests"


def test_directory_resolver_finds_adapters_and_refuses_escapes(base, tmp_path):
    root = tmp_path / "store"
    write_random_adapter(root / "tenant-7", base, rank=2, targets=["q_proj", "v_proj"], seed=7)
    outside = write_random_adapter(tmp_path / "outside", base, rank=2, targets=["q_proj"], seed=8)
    os.symlink(outside, root / "escape")  # a directory symlink out of the store
    (root / "half").mkdir()
    write_random_adapter(tmp_path / "half-src", base, rank=2, targets=["q_proj"], seed=9)
    shutil.copy(tmp_path / "half-src" / "adapter_config.json", root / "half")
    os.symlink(tmp_path / "half-src" / "adapter_model.safetensors", root / "half" / "adapter_model.safetensors")
    engine = Engine(EngineConfig(model_dir=str(base), resolvers=f"dir:{root}"))
    try:
        ok = generate(engine, [GenerationRequest("r", [0, 5, 6], "tenant-7", SamplingParams(max_tokens=5))])[0]
        assert ok.error is None
        assert ok.token_ids == peft_greedy(base, root / "tenant-7", [0, 5, 6], 5)
        assert "tenant-7" in [a["name"] for a in engine.list_adapters()]
        for name in ("escape", "half", "../outside", "/etc", "a/b", "..", "nope"):
            res = generate(engine, [GenerationRequest("x", [0, 5], name, SamplingParams(max_tokens=2))])[0]
            assert res.error is not None and res.error.code is ErrorCode.NOT_FOUND, name
    finally:
        engine.shutdown()


def test_hugging_face_cache_resolver(base, tmp_path):
    cache = tmp_path / "hub"
    repo = cache / "models--acme--support-bot"
    src = write_random_adapter(tmp_path / "src", base, rank=4, targets=["o_proj"], seed=11)
    revision = "0123456789abcdef0123456789abcdef01234567"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True)
    for i, name in enumerate(("adapter_config.json", "adapter_model.safetensors")):
        blob = repo / "blobs" / f"blob{i}"
        shutil.copy(src / name, blob)
        os.symlink(os.path.relpath(blob, snap), snap / name)
    engine = Engine(EngineConfig(model_dir=str(base), resolvers=f"hf-cache:{cache}"))
    try:
        res = generate(engine, [GenerationRequest("r", [0, 9, 4], "acme--support-bot",
                                                  SamplingParams(max_tokens=5))])[0]
        assert res.error is None
        assert res.token_ids == peft_greedy(base, src, [0, 9, 4], 5)
    finally:
        engine.shutdown()
