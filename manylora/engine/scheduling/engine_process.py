"""The engine in a process of its own, driven through a pipe (vLLM's EngineCore split).

Inside Triton's Python backend, the stub that receives requests and sends responses is one
process with one GIL. With the engine's step loop in that process too, every response the stub
sent waited for the loop's Python, and the server sent a third of what the engine produced. So
the model file holds an EngineProcess: the same calls as Engine (submit, cancel, count_refusal,
stats, list_adapters, load_adapter, unload_adapter, shutdown), carried to a child process that
runs the Engine. The child sends back, once per loop iteration, one message with every output
and observer event of that iteration; a thread here reads them at once, hands the events to the
observer and the outputs to delivery threads (manylora/engine/scheduling/delivery.py), which call
the requests' emit callbacks and merge a request's outputs while they wait, so that a slow
response path never stalls the engine. The stub's threads only move requests and responses.

A request's is_cancelled (a Triton response sender's flag) cannot cross processes: a thread here
polls it every CANCEL_POLL_S and sends a cancel. If the child dies, every request in flight ends
with UNAVAILABLE and later ones are refused with the reason. The child ends when the pipe closes,
and, given a host (EngineLaunch.host_pid: tritonserver, for the generator's stub), when its parent
is no longer the host's child: then it kills its parent, which may be stuck on the gone host, and stops.

    engine = EngineProcess(EngineLaunch(model_dir=..., catalogue_file=..., device="auto", knobs={}))
    engine.submit(GenerationRequest(...), emit)   # emit(GenerationOutput) from a delivery thread
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import itertools
import logging
import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from manylora.engine.errors import ErrorCode, RequestError
from manylora.engine.processes import python_for_children
from manylora.engine.repository_paths import without_triton_parameters
from manylora.engine.requests.types import EmitFn, GenerationOutput, GenerationRequest
from manylora.engine.scheduling.delivery import OutputDelivery
from manylora.engine.scheduling.observer import EngineObserver, NullObserver

log = logging.getLogger("manylora.engine")

CANCEL_POLL_S = 0.25  # how often the requests' cancellation flags are read here
HOST_CHECK_S = 1.0  # how often the child looks whether its parent's host is still there
CALL_TIMEOUT_S = 300.0  # stats / adapter calls into the child (an adapter load reads and hashes files)
SHUTDOWN_TIMEOUT_S = 30.0
# from the child's shutdown to its exit at most: past it, every thread's stack goes to the log and the child exits
# (code 1) on its own, before the parent's SHUTDOWN_TIMEOUT_S would kill it with nothing said
EXIT_WATCHDOG_S = 20.0
OBSERVER_EVENTS = ("request_arrived", "request_failed", "first_token", "request_finished", "adapter_loaded")


@dataclass(frozen=True)
class EngineLaunch:
    """What the child needs to build its Engine: plain values, so that the parent never imports torch."""

    model_dir: str
    catalogue_file: str | None = None  # a catalogue JSON (manylora.engine.adapters.catalogue.load_catalogue_file)
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:N"
    knobs: dict[str, str] = field(default_factory=dict)  # EngineConfig fields as strings (from_strings)
    host_pid: int | None = None  # the process the parent serves in: when it is gone, parent and engine end

    def engine_config(self):
        from manylora.engine.adapters.catalogue import load_catalogue_file
        from manylora.engine.config import EngineConfig
        from manylora.engine.devices import resolve_device

        adapters = load_catalogue_file(self.catalogue_file) if self.catalogue_file else {}
        # a rendered generator's config.pbtxt may name the packed environment (Triton's, not an engine knob)
        knobs = without_triton_parameters(self.knobs)
        return EngineConfig.from_strings(knobs, model_dir=self.model_dir, adapters=adapters,
                                         device=resolve_device(self.device))


class EngineFailedToStart(RuntimeError):
    """The child could not build its Engine; the message is the child's error."""


class EngineProcess:
    """Parent side of the engine process (module docstring)."""

    def __init__(self, launch: EngineLaunch, observer: EngineObserver | None = None) -> None:
        self.observer: EngineObserver = observer or NullObserver()
        ctx = multiprocessing.get_context("spawn")
        ctx.set_executable(python_for_children())
        self._conn, child_conn = ctx.Pipe(duplex=True)
        # not a daemon: the engine starts processes of its own (tensor-parallel ranks, adapter loaders); it ends
        # when the pipe closes, so it never outlives this process for long
        self._process = ctx.Process(target=run_engine, args=(launch, child_conn), name="manylora-engine")
        self._process.start()
        child_conn.close()
        self._send_lock = threading.Lock()
        self._live: dict[str, tuple[EmitFn, Callable[[], bool] | None]] = {}
        self._live_lock = threading.Lock()
        self._cancelled: set[str] = set()
        self._calls: dict[int, _Call] = {}
        self._call_ids = itertools.count()
        self._dead: str | None = None
        self._stopping = threading.Event()
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            kind, payload = "failed", f"the engine process exited with code {self._exit_code()} while starting"
        if kind != "ready":
            self._process.join(10)
            raise EngineFailedToStart(payload)
        self.info: dict = payload  # device, dtype, max_model_len, ... as the child resolved them
        self._delivery = OutputDelivery(self._deliver)
        self._receiver = threading.Thread(target=self._receive, name="manylora-engine-receiver", daemon=True)
        self._receiver.start()
        self._poller = threading.Thread(target=self._poll_cancelled, name="manylora-cancel-poller", daemon=True)
        self._poller.start()

    # ------------------------------------------------------------------ requests
    def submit(self, request: GenerationRequest, emit: EmitFn) -> None:
        """Queue a request in the engine; a refusal arrives through ``emit`` as an error output."""
        if self._dead is not None:
            raise RequestError(ErrorCode.UNAVAILABLE, f"request {request.request_id}: {self._dead}")
        with self._live_lock:
            if request.request_id in self._live:
                raise RequestError(ErrorCode.INTERNAL, f"request id {request.request_id} is already in flight")
            self._live[request.request_id] = (emit, request.is_cancelled)
        self._send(("submit", dataclasses.replace(request, is_cancelled=None)))

    def cancel(self, request_id: str, why: str = "cancelled by the client") -> None:
        self._send(("cancel", request_id, why))

    def count_refusal(self, adapter: str | None, code: ErrorCode) -> None:
        self._send(("refused", adapter, code))

    # ------------------------------------------------------------------ calls
    def stats(self) -> dict:
        return self._call("stats")

    def list_adapters(self) -> list[dict]:
        return self._call("list_adapters")

    def load_adapter(self, name: str, path: str, sha256: str | None = None, replace: bool = False) -> dict:
        return self._call("load_adapter", name, path, sha256, replace)

    def unload_adapter(self, name: str) -> dict:
        return self._call("unload_adapter", name)

    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Stop the child (it fails what is still in flight) and wait for it."""
        self._stopping.set()
        with contextlib.suppress(RequestError):
            self._send(("shutdown",))
        self._process.join(timeout)
        if self._process.is_alive():
            log.warning("the engine process did not stop within %.0f s; killing it", timeout)
            self._process.kill()
            self._process.join(5)
        elif self._process.exitcode:
            log.warning("the engine process exited with code %s on shutdown (a stall in its exit writes its "
                        "threads' stacks above)", self._process.exitcode)
        self._receiver.join(5)
        self._delivery.close()

    def start(self) -> None:
        """Engine.start's counterpart: the child's loop runs from the start."""

    def is_alive(self) -> bool:
        return self._dead is None and self._process.is_alive()

    # ------------------------------------------------------------------ plumbing
    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as e:
            raise RequestError(ErrorCode.UNAVAILABLE, self._dead or f"the engine process is gone ({e})") from None

    def _call(self, method: str, *args: Any) -> Any:
        call = _Call()
        call_id = next(self._call_ids)
        self._calls[call_id] = call
        try:
            self._send(("call", call_id, method, args))
            if not call.done.wait(CALL_TIMEOUT_S):
                raise RequestError(ErrorCode.UNAVAILABLE, f"the engine did not answer '{method}' within "
                                                          f"{CALL_TIMEOUT_S:.0f} s")
        finally:
            self._calls.pop(call_id, None)
        if call.error is not None:
            raise call.error
        return call.value

    def _receive(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            try:
                self._handle(message)
            except Exception:  # noqa: BLE001 - one bad message must not stop the responses
                log.error("engine process message failed:\n%s", traceback.format_exc())
        self._child_gone()

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "batch":
            _, outputs, events = message
            for request_id, output in outputs:
                self._delivery.put(request_id, output)
            for name, args in events:
                getattr(self.observer, name)(*args)
        elif kind == "reply":
            _, call_id, value, error = message
            call = self._calls.get(call_id)
            if call is not None:
                call.value, call.error = value, error
                call.done.set()

    def _deliver(self, request_id: str, output: GenerationOutput) -> None:
        with self._live_lock:  # a finished request leaves _live before its final output goes (_poll_cancelled)
            entry = self._live.get(request_id)
            if entry is not None and output.finished:
                del self._live[request_id]
                self._cancelled.discard(request_id)
        if entry is not None:
            entry[0](output)

    def _poll_cancelled(self) -> None:
        """Read each live request's cancellation flag, and cancel in the engine those whose client has gone."""
        while not self._stopping.wait(CANCEL_POLL_S):
            with self._live_lock:
                candidates = [rid for rid, (_, check) in self._live.items()
                              if check is not None and rid not in self._cancelled]
            for request_id in candidates:
                if self._is_cancelled(request_id):
                    try:
                        self.cancel(request_id)
                    except RequestError:
                        return

    def _is_cancelled(self, request_id: str) -> bool:
        """A live request's flag, read under the lock that _deliver takes to retire a request, so never after the
        request's final output: reading a Triton sender's flag once its final response is sent touches a freed
        response factory and crashes the whole server (seen with 2.51). A method of its own, so that no reference
        to the request's sender or emit callback outlives the check: the poller's frame would otherwise hold the
        last one while it sleeps, and Triton cannot release (nor unload the model of) a request whose sender lives."""
        with self._live_lock:
            entry = self._live.get(request_id)
            if entry is None:
                return False
            try:
                cancelled = bool(entry[1]())
            except Exception:  # noqa: BLE001 - a broken sender counts as gone
                cancelled = True
            if cancelled:
                self._cancelled.add(request_id)
            return cancelled

    def _exit_code(self) -> int | None:
        self._process.join(1)
        return self._process.exitcode

    def _child_gone(self) -> None:
        """The pipe closed: fail what is in flight, answer waiting calls, refuse what comes."""
        code = self._exit_code()
        self._dead = ("the server is shutting down" if self._stopping.is_set()
                      else f"the engine process exited (code {code}); the server must be restarted")
        if not self._stopping.is_set():
            log.error("%s", self._dead)
        error = RequestError(ErrorCode.UNAVAILABLE, self._dead)
        for call in list(self._calls.values()):
            call.error = error
            call.done.set()
        with self._live_lock:
            live = list(self._live)
        for request_id in live:  # after the outputs that wait for delivery; the delivery retires it
            self._delivery.put(request_id, GenerationOutput(
                request_id=request_id, token_ids=[], context_ids=[], finished=True, finish_reason="error",
                error=RequestError(ErrorCode.UNAVAILABLE, f"request {request_id}: {self._dead}")))


@dataclass
class _Call:
    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    error: BaseException | None = None


# ---------------------------------------------------------------------- the child
class _Outbox:
    """The child's outputs and observer events, sent as one message per engine loop iteration.

    Only the engine thread appends outputs and flushes them, so a request's outputs leave in order;
    other threads send their own messages (a refusal at submit, a call's reply) whole."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.send_lock = threading.Lock()
        self.buffer_lock = threading.Lock()
        self.outputs: list[tuple[str, GenerationOutput]] = []
        self.events: list[tuple[str, tuple]] = []

    def emitter(self, request_id: str) -> EmitFn:
        def emit(output: GenerationOutput) -> None:
            with self.buffer_lock:
                self.outputs.append((request_id, output))
        return emit

    def event(self, name: str, args: tuple) -> None:
        with self.buffer_lock:
            self.events.append((name, args))

    def send(self, message: tuple) -> None:
        with self.send_lock:
            self.conn.send(message)

    def flush(self) -> None:
        with self.buffer_lock:
            if not self.outputs and not self.events:
                return
            outputs, self.outputs = self.outputs, []
            events, self.events = self.events, []
        self.send(("batch", outputs, events))


class _RecordingObserver:
    """The child's EngineObserver: records each event for the parent's observer."""

    def __init__(self, outbox: _Outbox) -> None:
        for name in OBSERVER_EVENTS:
            setattr(self, name, lambda *args, _name=name: outbox.event(_name, args))


def run_engine(launch: EngineLaunch, conn) -> None:
    """The child's main: build the Engine, then serve the parent's messages until shutdown or EOF."""
    from manylora.engine.scheduling.engine import Engine

    faulthandler.enable(all_threads=True)  # a crash in native code shows its Python stacks in the server's log
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    outbox = _Outbox(conn)
    try:
        engine = Engine(launch.engine_config(), observer=_RecordingObserver(outbox),
                        on_iteration=outbox.flush)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the model's start
        log.error("engine failed to start:\n%s", traceback.format_exc())
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    stats = engine.stats()
    info = {k: stats[k] for k in ("device", "dtype", "max_model_len", "tensor_parallel_size")}
    info.update(pid=os.getpid(), adapters=stats["adapters_registered"],
                runtime_adapters=engine.config.allow_runtime_adapters)
    conn.send(("ready", info))
    if launch.host_pid is not None:
        threading.Thread(target=_end_with_host, args=(launch.host_pid,), name="manylora-host-watch",
                         daemon=True).start()
    try:
        _serve(engine, outbox, conn)
    finally:
        arm_exit_watchdog(EXIT_WATCHDOG_S)
        started = time.monotonic()
        engine.shutdown()
        with contextlib.suppress(OSError, ValueError):
            outbox.flush()
        log.info("engine stopped in %.1f s", time.monotonic() - started)


def arm_exit_watchdog(seconds: float) -> None:
    """If this process is still here after ``seconds`` (an engine shutdown, a thread or a child process it waits
    for, the interpreter's own exit), write every thread's stack to stderr (the server's log) and exit with code 1."""
    faulthandler.dump_traceback_later(seconds, exit=True)


def _parent_of(pid: int) -> int | None:
    """A process's parent pid (from /proc), None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _end_with_host(host_pid: int) -> None:
    """Once this process's parent is no longer host_pid's child (the host exited: its children went to another
    parent), kill the parent and close the pipe: _serve sees the end, and the engine stops (module docstring)."""
    parent = os.getppid()
    if _parent_of(parent) != host_pid:  # no /proc to read, or launched by another process than the host's child
        log.warning("not watching host %d: it is not the parent of this engine's parent %d", host_pid, parent)
        return
    while _parent_of(parent) == host_pid:
        threading.Event().wait(HOST_CHECK_S)
    log.error("the host process %d is gone; ending its stub %d and this engine", host_pid, parent)
    with contextlib.suppress(OSError):
        os.kill(parent, signal.SIGKILL)


def _serve(engine, outbox: _Outbox, conn) -> None:
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        kind = message[0]
        if kind == "submit":
            request: GenerationRequest = message[1]
            try:
                engine.submit(request, outbox.emitter(request.request_id))
            except RequestError as e:
                refusal = GenerationOutput(request_id=request.request_id, token_ids=[], context_ids=[], finished=True,
                                           finish_reason="error", error=e, adapter=request.adapter)
                outbox.send(("batch", [(request.request_id, refusal)], []))
        elif kind == "cancel":
            engine.cancel(message[1], message[2])
        elif kind == "refused":
            engine.count_refusal(message[1], message[2])
        elif kind == "call":
            _, call_id, method, args = message
            value, error = None, None
            try:
                value = getattr(engine, method)(*args)
            except RequestError as e:
                error = e
            except Exception as e:  # noqa: BLE001 - the caller gets it as its call's error
                error = RequestError(ErrorCode.INTERNAL, f"{method} failed: {type(e).__name__}: {e}")
            outbox.send(("reply", call_id, value, error))
        elif kind == "shutdown":
            return
        else:
            log.error("unknown message from the parent: %r", kind)
