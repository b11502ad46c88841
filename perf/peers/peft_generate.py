"""Baselines on the same trace: transformers + PEFT, mixed-adapter batches or one adapter at a time.

Like S-LoRA's PEFT baseline these batch statically: a batch runs ``generate`` to its longest
output before the next starts. Token times come from a streamer (when each decoding step
produced its token), so a request ends at its own length even while its batch runs on; EOS
is off so lengths are exact. The base-only baseline is the engine itself on the trace with
no adapters (perf.workload.trace.base_only), not a PEFT run.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from perf.workload.records import RequestRecord
from perf.workload.replay import Clock, Tracker
from perf.workload.trace import TraceRequest

BASE = "__base__"  # PEFT's name for "no adapter" in adapter_names


@dataclass
class PeftBaselineConfig:
    """mode "mixed": generate(adapter_names=[...]) over whatever waits (FCFS); "single": the oldest
    request's adapter, set_adapter, and only that adapter's waiting requests."""

    mode: str = "mixed"
    max_batch_size: int = 16
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("mixed", "single"):
            raise ValueError(f"mode must be 'mixed' or 'single', got {self.mode!r}")
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")


def load_peft_model(base_dir: str | Path, adapters: dict[str, str], device: str, dtype: torch.dtype):
    """The base model with every adapter in ``adapters`` loaded under its name; returns (model, seconds)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    # straight onto the device (not a CPU copy first); adapters without initialising weights that the
    # file then overwrites: an 8B base + 100 adapters did not load within a 420 s H200 run otherwise
    try:
        model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=dtype, device_map=device)
    except (ImportError, ValueError):  # device_map needs accelerate in some transformers versions
        model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=dtype).to(device)
    names = list(adapters)
    if not names:
        raise ValueError("a PEFT baseline needs at least one adapter")
    model = PeftModel.from_pretrained(model, adapters[names[0]], adapter_name=names[0], low_cpu_mem_usage=True)
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name, low_cpu_mem_usage=True)
    model.eval()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return model, time.perf_counter() - t0


class _Steps:
    """A generate() streamer: on each decoding step, hands every request its token time."""

    def __init__(self, batch: list[tuple[TraceRequest, RequestRecord]], clock: Clock, tracker: Tracker) -> None:
        self.batch, self.clock, self.tracker = batch, clock, tracker
        self.step = -1  # the first put() is the prompt

    def put(self, value) -> None:
        self.step += 1
        if self.step == 0:
            return
        t = self.clock.now()
        for req, rec in self.batch:
            if self.step <= req.output_len:
                rec.add_chunk(t, 1)
                if self.step == req.output_len:
                    self.tracker.finish(rec, t)

    def end(self) -> None:
        """generate() is done; requests it did not finish are finished by the replay's cap."""


class PeftTarget:
    """A static-batching PEFT server on a worker thread; send() only queues."""

    def __init__(self, model, config: PeftBaselineConfig, device: str, name: str | None = None) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.name = name or f"peft-{config.mode}"
        self.batches = 0
        self._waiting: deque[tuple[TraceRequest, RequestRecord, Clock, Tracker]] = deque()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def send(self, request: TraceRequest, record: RequestRecord, clock: Clock, tracker: Tracker) -> None:
        if request.prompt_ids is None:
            raise ValueError("the PEFT baselines need token ids (workload vocab_range or with_token_ids)")
        with self._cond:
            self._waiting.append((request, record, clock, tracker))
            self._cond.notify()

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=600)

    # ------------------------------------------------------------------ worker
    def _take(self) -> list[tuple[TraceRequest, RequestRecord, Clock, Tracker]]:
        with self._cond:
            while not self._waiting and not self._stop.is_set():
                self._cond.wait(0.1)
            if self._stop.is_set():
                return []
            n = self.config.max_batch_size
            if self.config.mode == "mixed":
                return [self._waiting.popleft() for _ in range(min(n, len(self._waiting)))]
            adapter = self._waiting[0][0].adapter
            chosen = [item for item in self._waiting if item[0].adapter == adapter][:n]
            for item in chosen:
                self._waiting.remove(item)
            return chosen

    def _loop(self) -> None:
        while not self._stop.is_set():
            batch = self._take()
            if not batch:
                continue
            try:
                self._run(batch)
            except Exception as e:  # noqa: BLE001 - report the failure on the batch's requests
                for _req, rec, clock, tracker in batch:
                    tracker.finish(rec, clock.now(), f"{type(e).__name__}: {e}")

    def _run(self, batch: list[tuple[TraceRequest, RequestRecord, Clock, Tracker]]) -> None:
        from transformers import StoppingCriteria, StoppingCriteriaList

        stop = self._stop

        class _Cap(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.full((input_ids.shape[0],), stop.is_set(), dtype=torch.bool, device=input_ids.device)

        reqs = [b[0] for b in batch]
        width = max(r.prompt_len for r in reqs)
        pad = self.config.pad_token_id
        ids = torch.tensor([[pad] * (width - r.prompt_len) + list(r.prompt_ids) for r in reqs], device=self.device)
        mask = torch.tensor([[0] * (width - r.prompt_len) + [1] * r.prompt_len for r in reqs], device=self.device)
        clock, tracker = batch[0][2], batch[0][3]
        streamer = _Steps([(b[0], b[1]) for b in batch], clock, tracker)
        gen = copy.deepcopy(self.model.generation_config)
        gen.eos_token_id = None  # exact lengths, as the engine's ignore_eos
        gen.max_new_tokens, gen.do_sample, gen.pad_token_id = max(r.output_len for r in reqs), False, pad
        kwargs = dict(
            input_ids=ids,
            attention_mask=mask,
            generation_config=gen,
            streamer=streamer,
            stopping_criteria=StoppingCriteriaList([_Cap()]),
        )
        self.batches += 1
        with torch.inference_mode():
            if self.config.mode == "mixed":
                self.model.generate(**kwargs, adapter_names=[r.adapter or BASE for r in reqs])
            elif reqs[0].adapter is None:
                with self.model.disable_adapter():
                    self.model.generate(**kwargs)
            else:
                self.model.set_adapter(reqs[0].adapter)
                self.model.generate(**kwargs)
