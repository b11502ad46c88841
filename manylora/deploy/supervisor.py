"""Run tritonserver (and the OpenAI front beside it) until it stops, and make sure it does stop.

tritonserver 2.51 can stay up after SIGTERM: once its exit timeout expires with streams still open it prints
"Exit timeout expired. Exiting immediately." and waits on its Python-backend stub forever, and after a cancelled
gRPC stream it can keep the generator model live and never ask its stub to finalize (docs/operations.md,
"Stopping"). An orchestrator kills it after its grace period; a server started by hand (``make serve``) would
hang on Ctrl-C. ``supervise`` forwards SIGINT / SIGTERM and, if the server is still there ``grace_s`` after its
own exit timeout, kills its process group (tritonserver and its stubs; the engine processes follow their stubs)
and says so. Once the server has exited it removes the shared-memory regions a kill left behind (those of the
server's own region prefix: manylora.deploy.shm_regions).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from manylora.deploy.shm_regions import prefix_of, remove_server_regions

TRITON_DEFAULT_EXIT_TIMEOUT_S = 30  # tritonserver's --exit-timeout-secs when not given


def exit_timeout_s(cmd: list[str]) -> float:
    """The ``--exit-timeout-secs`` of a tritonserver command line (its default where absent)."""
    for i, part in enumerate(cmd):
        if part.startswith("--exit-timeout-secs="):
            return float(part.split("=", 1)[1])
        if part == "--exit-timeout-secs" and i + 1 < len(cmd):
            return float(cmd[i + 1])
    return float(TRITON_DEFAULT_EXIT_TIMEOUT_S)


@dataclass(frozen=True)
class StopPolicy:
    """When a stopping server is killed: ``grace_s`` after its exit timeout, counted from the first signal."""

    exit_timeout_s: float = TRITON_DEFAULT_EXIT_TIMEOUT_S
    grace_s: float = 10.0
    poll_s: float = 0.1

    @property
    def kill_after_s(self) -> float:
        return self.exit_timeout_s + self.grace_s


def supervise(cmd: list[str], env: dict[str, str], front: list[str] | None = None,
              policy: StopPolicy | None = None) -> int:
    """Run ``cmd`` (tritonserver) in a process group of its own and ``front`` beside it; SIGINT / SIGTERM go to
    both; a server not gone ``policy.kill_after_s`` after the first signal is killed with its group. The front is
    stopped when the server exits, and the regions of the server's ``shm-region-prefix-name`` (where its command
    line sets one of shm_regions.new_prefix's) are removed. Returns the server's exit status (negative: the
    signal that ended it)."""
    policy = policy or StopPolicy(exit_timeout_s(cmd))
    processes: list[subprocess.Popen] = []
    stopping_since: list[float] = []

    def forward(signum, _frame) -> None:
        if not stopping_since:
            stopping_since.append(time.monotonic())
        for process in processes:
            if process.poll() is None:
                process.send_signal(signum)

    # the handlers first: a signal that comes while the processes start is forwarded, not taken by this process
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    child = None
    try:
        server = subprocess.Popen(cmd, env=env, start_new_session=True)
        processes.append(server)
        if front:
            child = subprocess.Popen(front)
            processes.append(child)
            if stopping_since:  # a signal came between the two starts
                child.send_signal(signal.SIGTERM)
        while server.poll() is None:
            if stopping_since and time.monotonic() - stopping_since[0] > policy.kill_after_s:
                print(f"serve: tritonserver did not stop within {policy.kill_after_s:g} s of the signal (its exit "
                      f"timeout {policy.exit_timeout_s:g} s + {policy.grace_s:g} s); killing it and its stubs",
                      file=sys.stderr, flush=True)
                _kill_group(server)
                break
            time.sleep(policy.poll_s)
        return server.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if processes and processes[0].poll() is None:  # this process is leaving without the server having stopped
            _kill_group(processes[0])
            processes[0].wait()
        if child is not None and child.poll() is None:
            child.terminate()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        _remove_regions_of(cmd)


def _remove_regions_of(cmd: list[str]) -> None:
    """After the server has exited: the shared-memory regions it left, said when there were any."""
    left = remove_server_regions(cmd)
    if left:
        print(f"serve: removed {len(left)} shared-memory region(s) the server left in /dev/shm "
              f"({prefix_of(cmd)}*)", file=sys.stderr, flush=True)


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        process.kill()
