"""The engine: admits requests, runs continuous-batching steps on its own thread, emits tokens.

    engine = Engine(EngineConfig(model_dir=..., adapters={...}))
    engine.submit(GenerationRequest(...), emit)   # emit(GenerationOutput) from the engine thread
"""

from __future__ import annotations

import contextlib
import logging
import queue
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable

import torch

from manylora.engine.adapters.catalogue import AdapterCatalogue
from manylora.engine.adapters.directory import AdapterDirectory
from manylora.engine.adapters.resolvers import load_resolvers
from manylora.engine.adapters.spec import AdapterSpec
from manylora.engine.config import EngineConfig
from manylora.engine.devices import resolve_device, resolve_kernels
from manylora.engine.errors import ErrorCode, RequestError
from manylora.engine.execution.step_builder import StepLists
from manylora.engine.model_config import ModelConfig, eos_token_ids
from manylora.engine.models.loader import resolve_dtype
from manylora.engine.requests.checks import check_request
from manylora.engine.requests.detokenize import IncrementalDecoder, load_tokenizer
from manylora.engine.requests.sampling import is_greedy, make_generator, sample_next
from manylora.engine.requests.types import EmitFn, GenerationOutput, GenerationRequest
from manylora.engine.scheduling.assembly import assemble
from manylora.engine.scheduling.engine_stats import engine_stats
from manylora.engine.scheduling.heartbeats import WAITING_HEARTBEATS_PER_S, due_heartbeats
from manylora.engine.scheduling.loop_times import LoopTimes
from manylora.engine.scheduling.observer import EngineObserver, NullObserver
from manylora.engine.scheduling.scheduler import ScheduledChunk
from manylora.engine.scheduling.sequence import Sequence, Status
from manylora.engine.scheduling.state_lock import LoopStateLock

log = logging.getLogger("manylora.engine")

PREFETCH_LOOKAHEAD = 64  # waiting requests whose adapters are loaded ahead
# how often cancellation flags are read and heartbeats sent; each read of a Triton response sender's flag is a round
# trip to the server process, so not every step
CANCEL_POLL_S = 0.2


class Engine:
    """One base model, a catalogue of adapters, a paged KV cache, and the step loop."""

    def __init__(self, config: EngineConfig, *, start: bool = True, observer: EngineObserver | None = None,
                 on_iteration: Callable[[], None] | None = None) -> None:
        """``on_iteration`` runs on the engine thread after each pass of its loop (at least every 50 ms): where an
        engine in a process of its own sends what the pass emitted (manylora/engine/scheduling/engine_process.py)."""
        self.config = config
        self._on_iteration = on_iteration
        if config.gil_switch_interval_us > 0:
            sys.setswitchinterval(config.gil_switch_interval_us / 1e6)
        self.observer: EngineObserver = observer or NullObserver()
        self.device = resolve_device(config.device)
        if self.device.startswith("cuda") and torch.device(self.device).index is not None:
            torch.cuda.set_device(torch.device(self.device))
        self.model_config = ModelConfig.from_dir(config.model_dir)
        cfg = self.model_config
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.use_kernels = resolve_kernels(config.kernels, self.device)
        self.max_len = config.max_model_len or cfg.max_position_embeddings
        self.tokenizer = load_tokenizer(config.model_dir)
        self.eos_ids = eos_token_ids(config.model_dir, cfg)
        self.catalogue = AdapterCatalogue(cfg, config.max_lora_rank)
        self.catalogue.register_all(config.adapters, strict=config.strict_adapters)
        self.directory = AdapterDirectory(self.catalogue, load_resolvers(config.resolvers),
                                          config.allow_runtime_adapters, config.list_adapter_paths)
        # the model, pool, KV cache, adapter tiers, scheduler, step builder and CUDA graphs, built in order (a failure
        # first stops what was started: manylora/engine/scheduling/assembly.py)
        parts = assemble(config, cfg, self.device, self.dtype, self.use_kernels, self.max_len, self.catalogue,
                         on_adapter_loaded=lambda name, seconds: self.observer.adapter_loaded(name, seconds))
        self.load_processes = parts.load_processes
        self.host_cache_bytes = parts.host_cache_bytes
        self.pool_config = parts.pool_config
        self.tp = parts.tp
        self.model = parts.model
        self.pool = parts.pool
        self.kv = parts.kv
        self.adapters = parts.adapters
        self.scheduler = parts.scheduler
        self.steps = parts.steps
        self.graphs = parts.graphs
        self.mixed_graphs = parts.mixed_graphs
        # on a GPU the forward is launched and then awaited, and loaders use the wait; on the CPU the
        # forward is the computation itself, and shutting loaders out of it would stall loading
        self._gate_loaders = self.device.startswith("cuda")
        self._inbox: queue.SimpleQueue[Sequence] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._state_lock = LoopStateLock()
        self._last_cancel_poll = 0.0
        self._paced_interval_s = config.stream_interval_ms / 1000  # the interval _pace_streams last gave
        self._stopping = threading.Event()
        self._counters = {"steps": 0, "requests": 0, "finished": 0, "errors": 0, "tokens_out": 0, "tokens_in": 0,
                          "heartbeats": 0}
        self.loop_times = LoopTimes()
        self._refused = 0  # requests refused before they were queued (submit, or the caller's own parsing)
        self._refused_lock = threading.Lock()
        self._cancels: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()  # (request id, why) from cancel()
        self._thread = threading.Thread(target=self._loop, name="manylora-engine", daemon=True)
        if start:
            self._thread.start()

    # ------------------------------------------------------------- admission
    def validate(self, request: GenerationRequest) -> AdapterSpec | None:
        """Raise RequestError if the request cannot be served; returns the adapter version to use."""
        p, rid = request.sampling, request.request_id
        if self.tp is not None and self.tp.broken:
            raise RequestError(ErrorCode.UNAVAILABLE, f"request {rid}: {self.tp.broken.splitlines()[0]}; "
                                                      f"the engine must be restarted")
        check_request(request, self.model_config.vocab_size, self.max_len)
        n = len(request.prompt_ids)
        spec = None
        if request.adapter:
            try:
                spec = self.directory.resolve(request.adapter)
            except RequestError as e:
                raise RequestError(e.code, f"request {rid}: {e.message}") from None
        need = self.kv.pages_needed(n + p.max_tokens) + (self.adapters.pages(spec) if spec else 0)
        if need > self.pool.num_pages:
            raise RequestError(ErrorCode.INVALID_ARG,
                               f"request {rid}: {n + p.max_tokens} tokens and its adapter need {need} pages, more "
                               f"than the pool's {self.pool.num_pages} pages")
        limit = self.config.max_queue_size
        if limit and len(self.scheduler.waiting) + self._inbox.qsize() >= limit:
            raise RequestError(ErrorCode.UNAVAILABLE,
                               f"request {rid}: queue full ({limit} waiting requests, max_queue_size); retry later")
        return spec

    # ----------------------------------------------------- adapter lifecycle
    def load_adapter(self, name: str, path: str, sha256: str | None = None, replace: bool = False) -> dict:
        """Register (or, with replace, re-version) an adapter while serving (``AdapterDirectory.load``)."""
        return self.directory.load(name, path, sha256, replace)

    def unload_adapter(self, name: str) -> dict:
        """Unregister an adapter: new requests get NOT_FOUND, admitted ones finish on their version."""
        return self.directory.unload(name)

    def submit(self, request: GenerationRequest, emit: EmitFn) -> None:
        """Validate and queue a request; raises RequestError (nothing queued) if it is bad."""
        try:
            spec = self.validate(request)
        except RequestError as e:
            self.count_refusal(request.adapter, e.code)
            raise
        seed = request.sampling.seed if request.sampling.seed is not None else random.getrandbits(63)
        decoder = IncrementalDecoder(self.tokenizer, track_text=bool(request.sampling.stop))
        seq = Sequence(request, emit, decoder, make_generator(seed), self.eos_ids,
                       self.max_len, spec, self.config.stream_interval_ms / 1000)
        self._counters["requests"] += 1
        self.observer.request_arrived(seq.adapter)
        self._inbox.put(seq)
        self._wake.set()

    def count_refusal(self, adapter: str | None, code: ErrorCode) -> None:
        """Count a request refused before it reached the engine (the caller could not even parse it), so that
        ``stats()["errors"]`` and the observer's error count are one count. Thread-safe."""
        with self._refused_lock:
            self._refused += 1
        self.observer.request_failed(adapter or None, code.value)

    def cancel(self, request_id: str, why: str = "cancelled by the client") -> None:
        """Stop a queued or running request (from any thread): it ends with a CANCELLED error before the next
        step; an id that is not (or no longer) in the engine is ignored."""
        self._cancels.put((request_id, why))
        self._wake.set()

    # ---------------------------------------------------------------- queries
    def list_adapters(self) -> list[dict]:
        return self.directory.list()

    def stats(self) -> dict:
        """Counters and pool state; safe from any thread (taken between two loop iterations)."""
        with self._state_lock.reading():
            counters = {**self._counters, "errors": self._counters["errors"] + self._refused}
            return engine_stats(self, counters, not_yet_queued=self._inbox.qsize())

    def start(self) -> None:
        """Start the step loop (an engine made with start=False; a no-op once running)."""
        if not self._thread.is_alive() and not self._stopping.is_set():
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the engine loop did not stop within %.0f s of the shutdown", timeout)
        self.adapters.host.shutdown()
        self.adapters.gpu.shutdown()
        if self.tp is not None:
            self.tp.shutdown()

    # ------------------------------------------------------------------- loop
    def _loop(self) -> None:
        if self.device.startswith("cuda") and torch.device(self.device).index is not None:
            torch.cuda.set_device(torch.device(self.device))  # the current device is per thread
        clock = time.perf_counter
        while not self._stopping.is_set():
            started = clock()
            with self._state_lock.iteration():  # stats() reads the pool and the queues between iterations
                ran = self._iterate()
            iterated = clock()
            if self._on_iteration is not None:
                try:
                    self._on_iteration()
                except Exception:  # noqa: BLE001 - the loop must go on; the hook's owner sees its own failure
                    log.error("on_iteration failed:\n%s", traceback.format_exc())
            hooked = clock()
            if ran is None:  # nothing to do
                self._wake.wait(0.05)
                self._wake.clear()
            elif not ran:  # waiting only on adapter loads
                self._wake.wait(0.002)
                self._wake.clear()
            self.loop_times.add(bool(ran), iterated - started, hooked - iterated, clock() - hooked)
        self._fail_all("the server is shutting down")
        if self._on_iteration is not None:
            with contextlib.suppress(Exception):
                self._on_iteration()

    def _iterate(self) -> bool | None:
        """One pass of the loop: admit what arrived, drop what was cancelled, run a step. None when
        there was no work; else whether a step ran."""
        self._drain_inbox()
        self._drop_cancelled()
        if not self.scheduler.has_work():
            return None
        self._pace_streams()
        try:
            self._prefetch()
            return self.step()
        except Exception:  # noqa: BLE001 - the engine must outlive any one bad step
            log.error("engine step failed:\n%s", traceback.format_exc())
            if self.tp is not None and self.tp.broken:  # no step can run again: fail what waits
                self._fail_all(self.tp.broken.splitlines()[0])
            return True

    def _pace_streams(self) -> None:
        """With stream_responses_per_s, each running stream's interval: (streams running) / that rate, never below
        stream_interval_ms (EngineConfig says why)."""
        rate = self.config.stream_responses_per_s
        if rate <= 0:
            return
        floor = self.config.stream_interval_ms / 1000
        streams = [seq for seq in self.scheduler.running if seq.request.stream]
        interval = max(floor, len(streams) / rate)
        if interval == floor == self._paced_interval_s:  # few streams: each has the floor since its submit
            return
        self._paced_interval_s = interval
        for seq in streams:
            seq.stream_interval_s = interval

    def _drain_inbox(self) -> None:
        while True:
            try:
                self.scheduler.add(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _drop_cancelled(self) -> None:
        """End what cancel() named; then, at most every CANCEL_POLL_S, poll the requests' cancellation flags and send
        the heartbeats that are due (GenerationRequest.keepalive_s)."""
        named = []
        while True:
            try:
                named.append(self._cancels.get_nowait())
            except queue.Empty:
                break
        if named:
            reasons = dict(named)
            for seq in [*self.scheduler.running, *self.scheduler.waiting]:
                why = reasons.get(seq.request_id)
                if why is not None:
                    self._finish_with_error(seq, RequestError(ErrorCode.CANCELLED, f"request {seq.request_id}: {why}"))
        now = time.perf_counter()
        if now - self._last_cancel_poll < CANCEL_POLL_S:
            return
        self._last_cancel_poll = now
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            check = seq.request.is_cancelled
            try:
                cancelled = bool(check and check())
            except Exception:  # noqa: BLE001 - a broken sender counts as gone
                cancelled = True
            if cancelled:
                self._finish_with_error(seq, RequestError(ErrorCode.CANCELLED,
                                                          f"request {seq.request_id}: cancelled by the client"))
        budget = round(WAITING_HEARTBEATS_PER_S * CANCEL_POLL_S)  # the waiting requests' share of this poll
        for seq in due_heartbeats(self.scheduler.running, self.scheduler.waiting, now, budget):
            self._counters["heartbeats"] += 1
            self._emit(seq, GenerationOutput(request_id=seq.request_id, token_ids=[], context_ids=[],
                                             heartbeat=True, adapter=seq.adapter, adapter_sha256=seq.adapter_sha256))

    def _fail_all(self, why: str) -> None:
        self._drain_inbox()
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._finish_with_error(seq, RequestError(ErrorCode.UNAVAILABLE, f"request {seq.request_id}: {why}"))

    def _prefetch(self) -> None:
        """Start host loads of queued requests' adapters; with async uploads, copy those already in host
        memory into free pages ahead of admission (never evicting, leaving a page per running sequence)."""
        pages = self.pool.pages
        upload_slots = self.config.max_num_seqs - len(self.scheduler.running)
        if not self.config.async_adapter_uploads:
            upload_slots = 0
        for i, seq in enumerate(self.scheduler.waiting):
            if i >= PREFETCH_LOOKAHEAD:
                break
            spec = seq.spec
            if not spec:
                continue
            self.adapters.prefetch(spec)
            if i >= upload_slots or self.adapters.gpu.get(spec) is not None or not self.adapters.host.contains(spec):
                continue
            spare = self.kv.pages_needed(seq.num_tokens() + 1) + len(self.scheduler.running)
            if pages.can_allocate(self.adapters.pages(spec) + spare):
                self.adapters.start_upload(spec)

    def step(self) -> bool:
        """One scheduling decision and one forward pass; False when nothing could run.

        A failure fails only the requests that cause it, before their state advances: if the batched forward
        raises, each sequence of the step runs again alone and only those that fail alone are failed; a request
        whose own sampling or output fails is failed alone; every other request advances as if nothing happened.
        """
        plan, failed = self.scheduler.schedule()
        for seq, error in failed:
            self._finish_with_error(seq, RequestError(ErrorCode.UNAVAILABLE, f"request {seq.request_id}: {error}"))
        if not plan:
            return bool(failed)
        gate = self.adapters.host.launch_gate
        try:
            if self._gate_loaders:
                gate.clear()  # adapter loaders wait while this step's kernels are launched
            lists, logits = self._forward(plan)
        except Exception:
            gate.set()
            if len(plan) == 1:
                self._fail_step(plan[0], traceback.format_exc())
            else:
                log.warning("a step of %d sequences failed; running each alone to find the cause:\n%s",
                            len(plan), traceback.format_exc())
                self._run_alone(plan)
            if self.tp is not None and self.tp.broken:  # no step can run again: fail what waits
                self._fail_all(self.tp.broken.splitlines()[0])
            return True
        gate.set()  # launched: loaders run while the device computes (sampling waits for it)
        self._counters["steps"] += 1
        self._advance(plan, lists.sampled, logits)
        return True

    def _forward(self, plan: list[ScheduledChunk]) -> tuple[StepLists, torch.Tensor]:
        """The step's forward: a decode CUDA graph, a mixed-step graph or the eager model; logits [sampled, V]."""
        build = self.steps
        lists = build.gather(plan)
        graph_inputs = None
        if self.graphs is not None and build.is_decode_only(plan) and self.graphs.fits(len(plan)):
            graph_inputs = build.graph_inputs(plan, lists)
        mixed = self.mixed_graphs
        if graph_inputs is not None and self.graphs.serves(graph_inputs.adapters):
            logits = self.graphs.run(graph_inputs)
        elif mixed is not None and mixed.fits(len(lists.ids), len(plan)) and build.pages_only(plan):
            logits = mixed.run(build.mixed_inputs(plan, lists))
        else:
            logits = self.model.forward(build.step_batch(plan, lists), self.kv, build.lora_batch(plan))
        return lists, logits

    def _run_alone(self, plan: list[ScheduledChunk]) -> None:
        """After a failed batched forward: each chunk's forward alone (eager; it rewrites the same KV slots). Those
        that fail alone are failed; the others advance."""
        for chunk in plan:
            try:
                lists = self.steps.gather([chunk])
                logits = self.model.forward(self.steps.step_batch([chunk], lists), self.kv,
                                            self.steps.lora_batch([chunk]))
            except Exception:  # noqa: BLE001 - this sequence's own step fails: it alone is failed
                self._fail_step(chunk, traceback.format_exc())
                continue
            self._advance([chunk], lists.sampled, logits)

    def _fail_step(self, chunk: ScheduledChunk, trace: str) -> None:
        seq = chunk.sequence
        log.error("request %s: step failed:\n%s", seq.request_id, trace)
        reason = trace.strip().splitlines()[-1][:300]
        self._finish_with_error(seq, RequestError(ErrorCode.INTERNAL, f"request {seq.request_id}: step failed: "
                                                                      f"{reason}"))

    def _advance(self, plan: list[ScheduledChunk], sampled: list[Sequence], logits: torch.Tensor) -> None:
        """Commit a step: each chunk's tokens are computed, each sampled sequence gets its next token. A sequence
        whose sampling or output handling raises is failed alone (its state is dropped with it)."""
        row_of = {id(seq): row for row, seq in enumerate(sampled)}
        greedy = torch.argmax(logits, dim=-1).tolist() if sampled else []
        for chunk in plan:
            seq = chunk.sequence
            row = row_of.get(id(seq))
            if row is None:  # a prefill chunk that does not reach the end of the prompt: no token yet
                seq.num_computed += chunk.num_tokens
                self._counters["tokens_in"] += chunk.num_tokens
                continue
            params = seq.request.sampling
            try:
                token = greedy[row] if is_greedy(params) else sample_next(logits[row], params, seq.generator)
            except Exception as e:  # noqa: BLE001 - one request's sampling fails it alone
                log.warning("request %s: sampling failed: %s", seq.request_id, e)
                self._finish_with_error(seq, RequestError(ErrorCode.INTERNAL,
                                                          f"request {seq.request_id}: sampling failed: {e}"))
                continue
            seq.num_computed += chunk.num_tokens
            self._counters["tokens_in"] += chunk.num_tokens
            try:
                self._take_token(seq, token)
            except Exception as e:  # noqa: BLE001 - e.g. a detokenizer error: this request alone
                log.warning("request %s: output failed:\n%s", seq.request_id, traceback.format_exc())
                self._finish_with_error(seq, RequestError(ErrorCode.INTERNAL,
                                                          f"request {seq.request_id}: output failed: {e}"))

    def _take_token(self, seq: Sequence, token: int) -> None:
        before = len(seq.output_ids)
        seq.append_token(token)
        self._counters["tokens_out"] += len(seq.output_ids) - before  # an EOS ends the request, it is no output
        self._observe_token(seq)
        output = seq.next_output()
        finishing = seq.finish_reason is not None and seq.status is not Status.FINISHED
        if finishing:
            self.scheduler.remove(seq)  # its pages are free before its client hears that it finished
        if output is not None and not self._emit(seq, output):
            if finishing:
                self._count_undelivered(seq)
            return
        if finishing:
            self._counters["finished"] += 1
            self.observer.request_finished(seq.adapter, len(seq.prompt_ids), len(seq.output_ids),
                                           seq.finish_reason, seq.time_per_output_token())

    def _observe_token(self, seq: Sequence) -> None:
        now = time.perf_counter()
        if seq.first_token_at is None:
            seq.first_token_at = now
            queue_s = (seq.admitted_at or now) - seq.submitted_at
            self.observer.first_token(seq.adapter, queue_s, now - seq.submitted_at)
        seq.last_token_at = now

    def _emit(self, seq: Sequence, output: GenerationOutput) -> bool:
        """Hand one output to its client; False (the request ended, its pages freed) when the client's callback
        raised."""
        seq.last_output_at = time.perf_counter()
        try:
            seq.emit(output)
            return True
        except Exception:  # noqa: BLE001 - a client gone away must not stop the engine
            log.warning("request %s: emit failed:\n%s", seq.request_id, traceback.format_exc())
            if seq.status is not Status.FINISHED:
                seq.finish_reason = seq.finish_reason or "error"
                self.scheduler.remove(seq)
                self._count_undelivered(seq)
            return False

    def _count_undelivered(self, seq: Sequence) -> None:
        self._counters["errors"] += 1
        self.observer.request_failed(seq.adapter, ErrorCode.UNAVAILABLE.value)

    def _finish_with_error(self, seq: Sequence, error: RequestError) -> None:
        if seq.status is Status.FINISHED:  # already ended (an emit that failed earlier in this pass)
            return
        self.scheduler.remove(seq)
        seq.finish_reason = "cancelled" if error.code is ErrorCode.CANCELLED else "error"
        self._counters["errors"] += 1
        self.observer.request_failed(seq.adapter, error.code.value)
        self._emit(seq, GenerationOutput(
            request_id=seq.request_id, token_ids=[], context_ids=[], finished=True,
            finish_reason=seq.finish_reason, error=error, adapter=seq.adapter, adapter_sha256=seq.adapter_sha256))
