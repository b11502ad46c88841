"""perf/engine/profile_engine.py wraps the engine's step phases by name: a run on the CPU (tiny random model) must
find each one and account every step of the run to a phase."""

import json

from perf.engine.profile_engine import main


def test_profile_times_every_phase_of_a_run(tmp_path, capsys):
    main(["--shape", "tiny", "--device", "cpu", "--adapters", "0", "2", "--rate", "60", "--duration", "0.3",
          "--max-num-seqs", "8", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "profile.json").read_text())
    for run in report["runs"]:
        assert run["completed"] == run["sent"] > 0, run["name"]
        totals = run["phase_totals_s"]
        assert totals["forward_s"] > 0 and totals["sample_s"] > 0 and totals["schedule_s"] > 0, totals
        assert totals["step_s"] >= totals["forward_s"] + totals["sample_s"]
    steps = report["steps"]["n=2"]
    assert any(s["adapters"] > 0 for s in steps) and all(s["kind"] in ("graph", "mixed", "eager", "idle")
                                                         for s in steps)
    assert "phase totals" in capsys.readouterr().out
