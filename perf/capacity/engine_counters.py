"""The engine's own counters over one offline run, for the in-process engine and the server's engine alike.

``Engine.stats()`` (and the generator's ``stats`` control op, which answers with the same dict) counts from the
engine's start; a run's own figures are the difference between a reading before it and one after. They say where a
target's time went when two targets differ on the same requests: how many steps the engine ran (a server that
feeds it requests more slowly runs more, smaller steps), how those ran (CUDA graphs or eager), and what adapter
traffic they needed (uploads to the GPU, evictions, host-tier loads and their seconds), the heartbeats the `llm`
ensemble's requests were sent (each costs the text path what a chunk costs: heartbeats.py), and where the engine
loop's time went: in steps, in sending their outputs to the server's stub, or waiting for work (loop_times.py). A
server whose engine takes longer a step than the in-process engine on the same requests is slower in one of those.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

COUNTERS = ("steps", "steps_decode_graph", "steps_mixed_graph", "steps_eager", "preemptions", "adapter_uploads",
            "adapter_evictions", "host_loads", "host_misses", "host_load_seconds", "heartbeats",
            "loop_step_seconds", "loop_hook_seconds", "loop_idle_seconds")
LOOP_TIMES = COUNTERS[-3:]  # where the loop's wall time went (manylora/engine/scheduling/loop_times.py)


def run_counters(before: dict, after: dict) -> dict:
    """Each counter of ``COUNTERS`` that both readings have, as ``after - before`` (a run's own figures)."""
    return {k: round(after[k] - before[k], 3) for k in COUNTERS if k in before and k in after}


def loop_split(counters: dict, wall_s: float) -> tuple[float | None, ...]:
    """A run's loop seconds as (in the step, sending, waiting during the run, outside the run); None where the
    engine did not report a part.

    The readings bracket more than the run (the client processes start after the first reading and end before the
    second), and outside the run the engine has none of its requests: the loop's seconds beyond the run's wall time
    are waiting that no request of the run saw, so they are taken out of "waiting" and shown apart."""
    step, hook, idle = (counters.get(k) for k in LOOP_TIMES)
    if step is None or hook is None or idle is None:
        return step, hook, idle, None
    outside = min(idle, max(0.0, step + hook + idle - wall_s))
    return step, hook, idle - outside, outside


def counters_table(entries: Iterable[dict], label: Callable[[str], str]) -> str:
    """A markdown table of the offline entries that carry ``meta["engine_counters"]`` (``label``: target -> its
    name), with the wall time a step took on average and the loop's split of it (``loop_split``); empty when none
    carries them."""
    rows = [e for e in entries if e.get("meta", {}).get("engine_counters")]
    if not rows:
        return ""
    lines = ["| target | n | call | steps | ms a step | in the step | sending | waiting | outside the run "
             "| decode graph | mixed graph | eager | preemptions | adapter uploads | evictions | host loads "
             "| host misses | host load s | heartbeats |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in sorted(rows, key=lambda e: (e.get("call", 0), e["target"], e["adapters"])):
        c = e["meta"]["engine_counters"]
        steps = c.get("steps")
        per_step = [f"{1000 * seconds / steps:.2f}" if steps and seconds is not None else "-"
                    for seconds in (e["wall_s"], *loop_split(c, e["wall_s"]))]
        cells = [label(e["target"]), e["adapters"], e.get("call", "-"), "-" if steps is None else steps, *per_step,
                 *(c.get(k, "-") for k in COUNTERS[1:] if k not in LOOP_TIMES)]
        lines.append("| " + " | ".join(str(v) for v in cells) + " |")
    return "\n".join(lines) + "\n"
