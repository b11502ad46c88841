"""Which requests get a heartbeat at a poll: a response with no tokens that lets the `llm` ensemble see a silent
request's cancellation (GenerationRequest.keepalive_s; model_repository/generator/1/model.py says why).

Every heartbeat costs what a chunk of text costs (a generator response, an ensemble step, a postprocessing request,
its cancellation check and its answer: round trips through three Python stubs), and the postprocessing stub, one
instance so that a stream's chunks stay in order, delivers on the order of a thousand a second. A heartbeat for every
silent request would spend that on the queue: 1,000 requests submitted at once, 256 running, left 744 waiting that
each asked for one every 0.4 s, as many heartbeats as the running streams had chunks of text. So a running request
that has been silent for its keepalive_s always gets one (its client waits on it), while the waiting ones share
WAITING_HEARTBEATS_PER_S, the longest silent first: a cancelled request in the queue is still seen (its turn comes
within waiting / WAITING_HEARTBEATS_PER_S seconds, or at once when it starts running, its first chunk asking too),
and no queue, however long, takes the text path's capacity from the streams that run.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Protocol

WAITING_HEARTBEATS_PER_S = 100  # heartbeats a second for all the waiting requests together


class Silent(Protocol):
    """What the choice reads of a sequence: its keepalive (None: no heartbeats) and when it last said anything."""

    @property
    def keepalive_s(self) -> float | None: ...

    last_output_at: float


def due_heartbeats(running: Iterable[Silent], waiting: Iterable[Silent], now: float,
                   waiting_budget: int) -> list[Silent]:
    """The sequences to send a heartbeat now: every ``running`` one silent for its keepalive_s, and of the
    ``waiting`` ones so silent at most ``waiting_budget``, the longest silent first (``now``: the clock of
    ``last_output_at``)."""
    def due(seq: Silent) -> bool:
        return seq.keepalive_s is not None and now - seq.last_output_at >= seq.keepalive_s

    chosen = [seq for seq in running if due(seq)]
    chosen += heapq.nsmallest(max(0, waiting_budget), (seq for seq in waiting if due(seq)),
                              key=lambda seq: seq.last_output_at)
    return chosen
