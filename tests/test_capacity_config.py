"""The capacity benchmark's command line (perf/capacity/config.py): what a call measures, refusals of a call that
could not be rated, and how a call records where its results went."""

from __future__ import annotations

import pytest

from perf.capacity.config import parse_args


def test_vllm_runs_at_every_adapter_count_of_the_call_by_default():
    cfg, _ = parse_args(["--shape", "tiny", "--adapters", "0,5,100", "--vllm-max-loras", "8,32"])
    assert cfg.vllm_max_loras == [8, 32]
    assert cfg.vllm_adapter_counts == [0, 5, 100]


def test_vllm_adapters_picks_a_subset_of_the_calls_counts():
    cfg, _ = parse_args(["--shape", "tiny", "--adapters", "100,1000", "--vllm-adapters", "100"])
    assert cfg.adapters == [100, 1000]
    assert cfg.vllm_adapter_counts == [100]


def test_vllm_adapters_outside_the_calls_counts_are_refused():
    with pytest.raises(ValueError, match=r"--vllm-adapters \[5\] must be among --adapters \[0, 100\]"):
        parse_args(["--shape", "tiny", "--adapters", "0,100", "--vllm-adapters", "5"])


def test_the_sweep_and_the_soak_drive_server_stream_unless_told_llm():
    cfg, _ = parse_args(["--shape", "tiny", "--soak", "60"])
    assert (cfg.sweep_target, cfg.soak_target) == ("server_stream", "server_stream") and "soak" in cfg.parts
    cfg, _ = parse_args(["--shape", "tiny", "--llm", "--sweep-target", "llm", "--soak-target", "llm", "--soak", "60"])
    assert (cfg.sweep_target, cfg.soak_target) == ("llm", "llm") and "llm" in cfg.targets


@pytest.mark.parametrize("option", ["--sweep-target", "--soak-target"])
def test_a_sweep_or_soak_of_a_target_that_takes_no_open_loop_load_is_refused(option, capsys):
    for target in ("engine", "server_nostream", "vllm"):
        with pytest.raises(SystemExit):
            parse_args(["--shape", "tiny", option, target])
        assert f"argument {option}: invalid choice: '{target}'" in capsys.readouterr().err
    from perf.capacity.config import CapacityConfig

    with pytest.raises(ValueError, match="--soak-target must be one of server_stream, llm, got 'vllm'"):
        CapacityConfig(soak_target="vllm")


def test_results_record_the_output_folder_as_out_and_repository_paths_relative(tmp_path, monkeypatch):
    from perf.capacity.command import REPO, display_path

    out = tmp_path / "device-out"
    out.mkdir()
    monkeypatch.setenv("OUT", str(out))
    assert display_path(out) == "$OUT"
    assert display_path(out / "calls" / "1") == "$OUT/calls/1"
    assert display_path(REPO / "perf" / "results" / "x") == "perf/results/x"
    elsewhere = tmp_path / "elsewhere"
    assert display_path(elsewhere) == str(elsewhere)
    monkeypatch.delenv("OUT")
    assert display_path(out) == str(out)
