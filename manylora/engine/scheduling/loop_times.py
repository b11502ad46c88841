"""Where the engine loop's wall time goes, for ``Engine.stats()``.

Two engines that run the same requests in the same number of steps can still differ in how long a step takes. The
loop's time splits three ways, and the split says why:

- ``loop_step_seconds``: iterations that ran a step (admission, scheduling, the forward and its wait for the GPU,
  sampling, emitting outputs to their callbacks). A step slower here is slower in the engine itself: its GPU work,
  or the CPU it gets (another thread holding the GIL, another process on its cores).
- ``loop_hook_seconds``: the ``on_iteration`` hook after each iteration; in the engine process (engine_process.py)
  that is sending the iteration's outputs to the server's stub, which waits when the stub reads them too slowly.
- ``loop_idle_seconds``: iterations that ran no step (nothing to do, or only adapter loads to wait for) and the
  waits after them: the engine waiting for work, e.g. for requests that reach it more slowly.

The three sum to the loop's wall time since it started (to the microseconds between readings).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoopTimes:
    """Seconds of the loop's wall time by where it went (module docstring); written by the loop's thread only."""

    step_s: float = 0.0
    hook_s: float = 0.0
    idle_s: float = 0.0

    def add(self, stepped: bool, iteration_s: float, hook_s: float, wait_s: float) -> None:
        """One pass of the loop: its iteration (``stepped``: whether it ran a step), its hook and the wait after."""
        if stepped:
            self.step_s += iteration_s
        else:
            self.idle_s += iteration_s
        self.hook_s += hook_s
        self.idle_s += wait_s

    def stats(self) -> dict[str, float]:
        return {"loop_step_seconds": round(self.step_s, 6), "loop_hook_seconds": round(self.hook_s, 6),
                "loop_idle_seconds": round(self.idle_s, 6)}
