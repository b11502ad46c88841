"""Iteration-level scheduling: which sequences run in the next step, and how many tokens each.

Every step, running sequences continue (a decode token, or the next prefill chunk), then
waiting ones join in arrival order while the token budget, the sequence limit, the
distinct-adapter limit (max_loras) and the free KV pages allow. When a running sequence
needs a page and none is free, the newest running sequence is preempted: its pages are
freed and it returns to the front of the queue, to be recomputed later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from backend.kv_cache import PagedKVCache
from backend.sequence import Sequence, Status


@dataclass
class ScheduledChunk:
    sequence: Sequence
    num_tokens: int  # tokens of all_ids[num_computed:] computed this step


class Scheduler:
    def __init__(self, kv: PagedKVCache, max_num_seqs: int, max_num_batched_tokens: int, max_loras: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_loras = max_loras
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
        self.kv.pool.free(seq)
        seq.status = Status.FINISHED

    def schedule(self) -> list[ScheduledChunk]:
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
        adapters = {s.adapter for s in self.running if s.adapter}
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.adapter and seq.adapter not in adapters and len(adapters) >= self.max_loras:
                break  # first come, first served: later requests do not overtake it
            whole = self.kv.pages_needed(seq.num_tokens() + 1)
            if not self.kv.pool.can_allocate(whole):
                break
            n = min(seq.num_tokens() - seq.num_computed, budget)
            self.waiting.popleft()
            self.kv.pool.allocate(seq, self.kv.pages_needed(n))
            seq.status = Status.RUNNING
            self.running.append(seq)
            if seq.adapter:
                adapters.add(seq.adapter)
            plan.append(ScheduledChunk(seq, n))
            budget -= n
        return plan

    def _reserve(self, seq: Sequence, num_tokens: int, plan: list[ScheduledChunk]) -> bool:
        """Make seq's pages cover num_tokens, preempting newer sequences if needed."""
        extra = self.kv.pages_needed(num_tokens) - len(self.kv.pool.pages_of(seq))
        while extra > 0 and not self.kv.pool.can_allocate(extra):
            planned = {c.sequence for c in plan}
            victims = [s for s in self.running if s is not seq and s not in planned]
            victim = max(victims, key=lambda s: s.arrival) if victims else seq
            self._preempt(victim)
            if victim is seq:
                return False
        if extra > 0:
            self.kv.pool.allocate(seq, extra)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.pool.free(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
