"""Switches for the whole suite.

MANYLORA_POISON_EMPTY=1: every Python-level ``torch.empty`` (and empty_like, empty_strided, new_empty) of every
test is filled with NaN / a huge index first, as stale GPU memory would be (``poison_empty.py``): code that reads
memory it never wrote (a KV page's tail, a table's padding, a skipped row) then fails here instead of on a GPU.
The unified pool, zeros when made, starts as NaN too: on a serving GPU its pages hold whatever the adapters and
sequences that had them before left.

Order: the longest tests run first (LONGEST_FIRST, from ``--durations`` on a 2-core machine), so that under
pytest-xdist (``make test``) no worker starts a two-minute test when the others are nearly done.
"""

import os

import pytest

# node id prefixes of the tests that take 20 s or more on a 2-core machine, longest first
LONGEST_FIRST = (
    "tests/kernels/test_step_graphs.py::test_mixed_steps_match_peft",
    "tests/kernels/test_engine_kernels.py::test_warm_up_runs_the_kernel_path",
    "tests/test_capacity.py",
    "tests/kernels/test_engine_kernels.py::test_moe_kernel_path_matches_peft",
    "tests/test_engine_isolation.py::test_no_request_changes_another_requests_output",
    "tests/test_unified_paging.py::test_two_thousand_adapters",
    "tests/kernels/test_engine_kernels.py::test_kernel_path_matches_peft",
    "tests/kernels/test_lora_kernels.py::test_shrink_expand_grid[64-130",
    "tests/kernels/test_engine_kernels.py::test_triton_base_gemm_matches_peft",
    "tests/e2e/test_e2e_child_processes.py",
    "tests/e2e/test_e2e_packed_env.py",
    "tests/kernels/test_decode_graph_forms.py",
)


# modules one xdist worker runs whole (``--dist loadgroup``): their tests share a module fixture that takes seconds
# to make (a capacity run, a compilation, a build, a server), which every worker given one of them would make again
WHOLE_MODULES = (
    "tests/test_capacity.py",
    "tests/test_compiled_code.py",
    "tests/test_embedded_build.py",
    "tests/test_engine_process.py",
    "tests/e2e/test_e2e_attacks.py",
    "tests/e2e/test_e2e_oracle.py",
    "tests/e2e/test_e2e_stream_interval.py",
    "tests/e2e/test_e2e_adapters_runtime.py",
)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's hook, which reads the xdist_group marks
def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        return next((i for i, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)), len(LONGEST_FIRST))

    for item in items:
        module = item.nodeid.split("::", 1)[0]
        if module in WHOLE_MODULES and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(module.rsplit("/", 1)[-1].removesuffix(".py")))
    items.sort(key=rank)  # stable: the rest keep their order


@pytest.fixture(autouse=True)
def _poisoned_empty_memory():
    if os.environ.get("MANYLORA_POISON_EMPTY") != "1":
        yield
        return
    from poison_empty import poison, poisoned_empty

    from manylora.engine.memory import unified_pool

    made = unified_pool.UnifiedPool.__init__

    def poisoned_pool(self, *args, **kwargs):
        made(self, *args, **kwargs)
        poison(self.storage)

    unified_pool.UnifiedPool.__init__ = poisoned_pool
    try:
        with poisoned_empty():
            yield
    finally:
        unified_pool.UnifiedPool.__init__ = made
