"""Client processes that drive the server open-loop over gRPC streaming, fast enough not to be the bottleneck.

The server can send thousands of responses a second, more than one Python process parses. So a
:class:`ClientPool` starts ``processes`` worker processes (spawned), each holding
``streams_per_process`` bidirectional ModelStreamInfer streams (decoupled models accept only that),
each on its own gRPC channel, with a thread reading each stream's responses. Many requests are in
flight on one stream at once; responses find their request by its id.

The streams use the gRPC service that tritonclient ships (``tritonclient.grpc.service_pb2``) below
tritonclient's stream wrapper: that wrapper hands an error response to its callback without the
response, so a stream carrying many requests could not tell which one failed; and requests are built
before the run starts, so the send path is one queue put.

The schedule is decided here, centrally: every send has an absolute time on CLOCK_MONOTONIC (shared by
all processes of the machine), sends never wait for completions, and each worker sends its share at
those times. Workers stamp every response with time.monotonic() and report their own CPU time over
the run (``time.process_time``: all their threads, gRPC's included), so a saturated client shows.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import threading
import time
import traceback
from dataclasses import dataclass

from perf.capacity.metrics import UNFINISHED, ClientLoad, digest
from perf.capacity.requests import ScheduledRequest
from perf.capacity.runs import RunOutcome, new_record
from perf.capacity.wire import RunSpec, SendSpec, build_request, count_response

IGNORE_EOS_UNKNOWN = "unexpected inference input 'ignore_eos'"
MAX_MESSAGE_BYTES = 2**31 - 1


class ServerLacksIgnoreEos(RuntimeError):
    """The server refused the ``ignore_eos`` input: exact output lengths cannot be asked for."""


@dataclass(frozen=True)
class ClientConfig:
    """How the load is generated.

    Attributes:
        processes: worker processes.
        streams_per_process: gRPC streams (each on its own channel) per worker.
        saturated_at: a worker whose CPU time over wall time passes this is reported saturated.
        start_lead_s: the run starts this long after the go is sent, so every worker starts on time.
    """

    processes: int = 4
    streams_per_process: int = 4
    saturated_at: float = 0.85
    start_lead_s: float = 0.25

    def __post_init__(self) -> None:
        if self.processes <= 0 or self.streams_per_process <= 0:
            raise ValueError("processes and streams_per_process must be > 0")


# ---------------------------------------------------------------------------------------------------------------------
# worker side


class _Pending:
    """One request in flight: its response times and token counts (absolute monotonic seconds)."""

    __slots__ = ("slot", "stream", "send", "times", "tokens", "ids", "chars", "end", "error")

    def __init__(self, slot: int, stream: int) -> None:
        self.slot = slot
        self.stream = stream
        self.send: float | None = None
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.ids: list[int] = []
        self.chars = 0
        self.end: float | None = None
        self.error: str | None = None


class _Run:
    """The bookkeeping of one run in a worker: pending requests by id, and when all have ended."""

    def __init__(self, text: bool) -> None:
        self.text = text
        self.pending: dict[str, _Pending] = {}
        self.open = 0
        self.lock = threading.Lock()
        self.all_done = threading.Event()
        self.responses = 0
        self.closed = False

    def finish(self, p: _Pending, t: float, error: str | None) -> None:
        with self.lock:
            if p.end is not None or self.closed:
                return
            p.end, p.error = t, error
            self.open -= 1
            if self.open == 0:
                self.all_done.set()


class _Stream:
    """One ModelStreamInfer call on its own channel; a thread reads its responses."""

    def __init__(self, url: str, index: int) -> None:
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        self.channel = grpc.insecure_channel(url, options=options)
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.index = index
        self.run: _Run | None = None
        self._open()

    def _open(self) -> None:
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled = False

        def iterate(q=self.requests):
            while True:
                item = q.get()
                if item is None:
                    return
                yield item

        self.responses = self.stub.ModelStreamInfer(iterate())
        self.reader = threading.Thread(target=self._read, name="capacity-stream", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        import grpc

        responses = self.responses
        try:
            for message in responses:
                t = time.monotonic()
                run = self.run
                if run is None:
                    continue
                response = message.infer_response
                p = run.pending.get(response.id)
                if p is None:
                    continue
                run.responses += 1
                if message.error_message:
                    run.finish(p, t, message.error_message)
                    continue
                count = count_response(response, run.text)
                if count.tokens:
                    p.times.append(t)
                    p.tokens.append(count.tokens)
                p.ids.extend(count.ids)
                p.chars += count.chars
                params = response.parameters
                if "triton_final_response" in params and params["triton_final_response"].bool_param:
                    run.finish(p, t, None)
        except grpc.RpcError as e:
            run = self.run
            if not self.cancelled and run is not None:
                t = time.monotonic()
                for p in list(run.pending.values()):
                    if p.send is not None and p.stream == self.index:
                        run.finish(p, t, f"stream failed: {e.code()}: {e.details()}")

    def send(self, request) -> None:
        self.requests.put(request)

    def reset(self) -> None:
        """Cancel what is in flight and open a fresh stream."""
        self.cancelled = True
        self.responses.cancel()
        self.requests.put(None)
        self.reader.join(timeout=10)
        self._open()

    def close(self) -> None:
        self.cancelled = True
        self.requests.put(None)
        with contextlib.suppress(Exception):
            self.responses.cancel()
        self.reader.join(timeout=10)
        self.channel.close()


def _execute(streams: list[_Stream], spec: RunSpec, built: list, t0: float, deadline: float, tag: str) -> tuple:
    """Send the share at its times, wait for its end or the deadline; (rows, cpu_s, wall_s, responses)."""
    run = _Run(text=spec.text)
    pendings = [_Pending(s.slot, k % len(streams)) for k, s in enumerate(spec.sends)]
    run.pending = {f"{tag}-{s.slot}": p for s, p in zip(spec.sends, pendings, strict=True)}
    run.open = len(pendings)
    if not pendings:
        run.all_done.set()
    for s in streams:
        s.run = run
    delay = t0 - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    cpu0, wall0 = time.process_time(), time.monotonic()
    for s, request, p in zip(spec.sends, built, pendings, strict=True):
        delay = t0 + s.offset_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        p.send = time.monotonic()
        try:
            streams[p.stream].send(request)
        except Exception as e:  # noqa: BLE001 - a refused send is a result
            run.finish(p, time.monotonic(), f"send failed: {e}")
    finished = run.all_done.wait(max(0.0, deadline - time.monotonic()))
    with run.lock:
        run.closed = True
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    if not finished:
        for s in streams:
            s.reset()
    for s in streams:
        s.run = None
    rows = []
    for p in pendings:
        error = p.error if p.end is not None else (UNFINISHED if p.send is not None else None)
        ids = p.ids if not run.text else None
        rows.append((p.slot, p.send, p.times, p.tokens, p.chars, p.end, error,
                     digest(ids) if ids is not None else None, ids if spec.keep_ids else None))
    return rows, cpu, wall, run.responses


def _worker(conn, url: str, streams_per_process: int) -> None:
    """A client process: connect, then serve ("prepare", spec) / ("go", t0, deadline, tag) / ("close",)."""
    try:
        from tritonclient.grpc import service_pb2 as pb

        streams = [_Stream(url, k) for k in range(streams_per_process)]
        conn.send(("up",))
        spec: RunSpec | None = None
        built: list = []
        while True:
            message = conn.recv()
            if message[0] == "close":
                break
            if message[0] == "prepare":
                spec, tag = message[1], message[2]
                built = [build_request(pb, f"{tag}-{s.slot}", s, spec) for s in spec.sends]
                conn.send(("ready",))
            elif message[0] == "go":
                _, t0, deadline, tag = message
                conn.send(("done", *_execute(streams, spec, built, t0, deadline, tag)))
        for s in streams:
            s.close()
    except Exception:  # noqa: BLE001 - hand the trace to the coordinator
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))


# ---------------------------------------------------------------------------------------------------------------------
# coordinator side


class ClientPool:
    """Worker processes with open streams to the server at ``url``; :meth:`run` drives one schedule."""

    def __init__(self, url: str, config: ClientConfig) -> None:
        self.url = url
        self.config = config
        self._runs = 0
        context = mp.get_context("spawn")  # gRPC is not fork-safe
        self._conns = []
        self._procs = []
        for _ in range(config.processes):
            parent, child = context.Pipe()
            proc = context.Process(target=_worker, args=(child, url, config.streams_per_process), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        self._gather("up", timeout=120)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _gather(self, kind: str, timeout: float) -> list[tuple]:
        replies = []
        for k, conn in enumerate(self._conns):
            if not conn.poll(timeout):
                raise RuntimeError(f"client process {k} sent no '{kind}' within {timeout:.0f} s")
            reply = conn.recv()
            if reply[0] == "error":
                raise RuntimeError(f"client process {k} failed:\n{reply[1]}")
            if reply[0] != kind:
                raise RuntimeError(f"client process {k}: expected '{kind}', got {reply[0]!r}")
            replies.append(reply)
        return replies

    def run(
        self,
        schedule: list[ScheduledRequest],
        *,
        model: str,
        stream: bool,
        ignore_eos: bool,
        cap_s: float,
        keep_ids: bool,
    ) -> RunOutcome:
        """Send ``schedule`` (offsets from the run's start) and collect one record per send."""
        self._runs += 1
        tag = f"c{self._runs}"
        records = [new_record(s) for s in schedule]
        n = len(self._conns)
        shares: list[list[SendSpec]] = [[] for _ in range(n)]
        for slot, item in enumerate(schedule):
            r = item.request
            shares[slot % n].append(SendSpec(slot, item.offset_s, r.prompt_ids, r.output_len, r.adapter))
        for conn, share in zip(self._conns, shares, strict=True):
            conn.send(("prepare", RunSpec(model, stream, ignore_eos, keep_ids, share), tag))
        self._gather("ready", timeout=300)
        t0 = time.monotonic() + self.config.start_lead_s
        for conn in self._conns:
            conn.send(("go", t0, t0 + cap_s, tag))
        replies = self._gather("done", timeout=cap_s + self.config.start_lead_s + 120)
        clients = []
        for k, (_, rows, cpu, wall, responses) in enumerate(replies):
            clients.append(ClientLoad(process=k, cpu_s=cpu, wall_s=wall, requests=len(rows), responses=responses))
            for slot, send, times, tokens, chars, end, error, out_digest, ids in rows:
                rec = records[slot]
                rec.send_s = None if send is None else send - t0
                for t, count in zip(times, tokens, strict=True):
                    rec.add_chunk(t - t0, count)
                rec.output_chars = chars
                rec.end_s = None if end is None else end - t0
                rec.error, rec.output_digest, rec.output_ids = error, out_digest, ids
        refused = next((r.error for r in records if r.error and IGNORE_EOS_UNKNOWN in r.error), None)
        if refused:
            raise ServerLacksIgnoreEos(
                f"the server's {model} model refused the ignore_eos input ({refused!r}): it cannot be asked for exact "
                f"output lengths, so its throughput would not compare with the engine's. Update model_repository/"
                f"{model} (config.pbtxt input ignore_eos BOOL [1] and its parsing) and run again."
            )
        ends = [r.end_s for r in records if r.end_s is not None]
        capped = any(r.error == UNFINISHED for r in records)
        end = cap_s if capped else max(ends, default=0.0)
        return RunOutcome(records=records, end_s=end, capped=capped, clients=clients)

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(Exception):
                conn.send(("close",))
        for proc in self._procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)


@dataclass
class ServerDriver:
    """A :class:`~perf.capacity.runs.Driver` that sends through the pool to one model, streaming or not."""

    pool: ClientPool
    model: str = "generator"
    stream: bool = True
    ignore_eos: bool = True

    def run(self, schedule: list[ScheduledRequest], *, cap_s: float, keep_ids: bool) -> RunOutcome:
        return self.pool.run(schedule, model=self.model, stream=self.stream, ignore_eos=self.ignore_eos,
                             cap_s=cap_s, keep_ids=keep_ids)


def saturated(clients: list[ClientLoad], config: ClientConfig) -> list[ClientLoad]:
    """The client processes whose CPU use passed ``config.saturated_at`` of a core."""
    return [c for c in clients if c.utilization >= config.saturated_at]
