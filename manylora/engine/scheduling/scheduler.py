"""Iteration-level scheduling: which sequences run in the next step, and how many tokens each.

Every step, running sequences continue (a decode token, or the next prefill chunk), then
waiting ones join in arrival order while the token budget, the sequence limit, the
distinct-adapter limit (max_loras) and the pool's pages allow. A waiting request whose
adapter is still being read from disk, or copied into the pool, is passed over (it keeps its
place); one whose adapter would exceed max_loras, or does not fit, stops admission so nobody
overtakes it. With ``async_uploads`` an adapter in host memory is not copied into the pool by
the engine thread: its pages are taken and a worker copies it while steps go on; its request
joins once the copy is done.
Pages come from the unified pool: idle resident adapters are evicted first; when a running
sequence still needs a page, the newest running sequence is preempted (its pages freed,
back to the front of the queue, recomputed later).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from manylora.engine.errors import AdapterError
from manylora.engine.memory.adapter_manager import AdapterManager, Readiness
from manylora.engine.memory.kv_cache import PagedKVCache
from manylora.engine.scheduling.sequence import Sequence, Status


@dataclass
class ScheduledChunk:
    sequence: Sequence
    num_tokens: int  # tokens of all_ids[num_computed:] computed this step


class Scheduler:
    def __init__(self, kv: PagedKVCache, adapters: AdapterManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_loras: int, admit_every_steps: int = 1, async_uploads: bool = False) -> None:
        self.kv = kv
        self.pages = kv.pool.pages
        self.adapters = adapters
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_loras = max_loras
        # Admit waiting requests only every N steps while others run: a step with a prefill is
        # eager, a decode-only step can replay a CUDA graph (1 = admit at every step).
        self.admit_every_steps = admit_every_steps
        self.async_uploads = async_uploads
        self._steps_since_admit = 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished, cancelled or failed) and free its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pages.free(seq)
        seq.status = Status.FINISHED

    def pinned_adapters(self) -> set[tuple[str, str]]:
        """(name, sha256) of every adapter version a running request uses."""
        return {s.adapter_key for s in self.running if s.spec}

    def schedule(self) -> tuple[list[ScheduledChunk], list[tuple[Sequence, AdapterError]]]:
        """The next step's chunks, and waiting requests whose adapter failed to load."""
        budget = self.max_num_batched_tokens
        plan: list[ScheduledChunk] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_tokens() - seq.num_computed, budget)
            if not self._reserve(seq, seq.num_computed + n, plan):
                continue
            plan.append(ScheduledChunk(seq, n))
            budget -= n
        self._steps_since_admit += 1
        if self.running and self._steps_since_admit < self.admit_every_steps:
            return plan, []  # decode on; new requests join at the next admission step
        self._steps_since_admit = 0
        failed = self._admit(plan, budget)
        return plan, failed

    def _admit(self, plan: list[ScheduledChunk], budget: int) -> list[tuple[Sequence, AdapterError]]:
        failed: list[tuple[Sequence, AdapterError]] = []
        active = self.pinned_adapters()
        not_ready: set[tuple[str, str]] = set()  # adapters found loading or uploading in this pass
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            spec = seq.spec
            adapter_pages = 0
            if spec is not None:
                if seq.adapter_key in not_ready:  # many queued requests share an adapter: ask once
                    i += 1
                    continue
                try:
                    ready = self.adapters.readiness(spec)
                except AdapterError as e:
                    del self.waiting[i]
                    failed.append((seq, e))
                    continue
                if ready in (Readiness.LOADING, Readiness.UPLOADING):
                    not_ready.add(seq.adapter_key)
                    i += 1
                    continue
                if seq.adapter_key not in active and len(active) >= self.max_loras:
                    break
                adapter_pages = self.adapters.pages_to_admit(spec)
            need = self.kv.pages_needed(seq.num_tokens() + 1) + adapter_pages
            # requests ahead in the queue keep the adapters being copied in for them: evicting those
            # for a later request would only restart the copy at the next pass (the pool thrashes)
            keep = active | not_ready | ({seq.adapter_key} if spec else set())
            if not self.pages.can_allocate(need) and not self.adapters.make_room(need, keep):
                break
            if spec is not None:
                if self.async_uploads and ready is Readiness.HOST:
                    self.adapters.start_upload(spec)  # joins once the copy is done
                    not_ready.add(seq.adapter_key)
                    i += 1
                    continue
                self.adapters.make_resident(spec)
                active.add(seq.adapter_key)
            n = min(seq.num_tokens() - seq.num_computed, budget)
            del self.waiting[i]
            self.pages.allocate(seq, self.kv.pages_needed(seq.num_computed + n))
            seq.status = Status.RUNNING
            if seq.admitted_at is None:
                seq.admitted_at = time.perf_counter()
            self.running.append(seq)
            plan.append(ScheduledChunk(seq, n))
            budget -= n
        return failed

    def _reserve(self, seq: Sequence, num_tokens: int, plan: list[ScheduledChunk]) -> bool:
        """Make seq's pages cover num_tokens: evict idle adapters, else preempt newer sequences."""
        extra = self.kv.pages_needed(num_tokens) - len(self.pages.pages_of(seq))
        if extra <= 0:
            return True
        while not self.pages.can_allocate(extra):
            if self.adapters.make_room(extra, self.pinned_adapters()):
                break
            planned = {c.sequence for c in plan}
            victims = [s for s in self.running if s is not seq and s not in planned]
            victim = max(victims, key=lambda s: s.arrival) if victims else seq
            self._preempt(victim)
            if victim is seq:
                return False
        self.pages.allocate(seq, extra)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pages.free(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
