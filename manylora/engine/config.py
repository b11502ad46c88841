"""Engine configuration: one typed dataclass, filled from config.pbtxt parameters or code."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

# The LoRA kernels of steps under 64 tokens (decode_lora_kernels; execution/lora_batch.py applies them): "bgmv", one
# program per token for shrink and expand; "sgmv", tokens grouped by adapter slot for both; "hybrid", the BGMV
# shrink (its K-split programs read a token's A rows in parallel) and the SGMV expand (a 16-row tile reads each
# adapter's B rows once).
DECODE_FORMS = ("bgmv", "sgmv", "hybrid")
BASE_GEMMS = ("torch", "triton", "auto")  # EngineConfig.base_gemm
DECODE_BLAS = ("cublas", "cublaslt")  # EngineConfig.decode_gemm_blas (manylora/engine/layers/decode_gemms.py)


# the base GEMMs' projection groups of a decoder layer (q/k/v, o, gate/up, down), named by their first projection
PROJECTION_GROUPS = {"q_proj": "qkv", "o_proj": "o", "gate_proj": "gate_up", "down_proj": "down"}


def parse_group_carveouts(spec: str, what: str = "SM carveout") -> tuple[tuple[str, int], ...]:
    """``"qkv=48/gate_up=16"`` (or ``""``): per projection group (qkv, o, gate_up, down) the SMs its base GEMM leaves
    free in place of the graph's carveout. Raises a ValueError naming ``what`` and the spec."""
    known = sorted(set(PROJECTION_GROUPS.values()))
    pairs = []
    for part in filter(None, spec.split("/")):
        name, _, sms = part.partition("=")
        if name not in known or not sms.isdigit():
            raise ValueError(f"{what} {spec!r}: expected group=SMs entries joined by '/', e.g. qkv=48/gate_up=16, "
                             f"with groups {', '.join(known)} and counts >= 0; got {part!r}")
        pairs.append((name, int(sms)))
    return tuple(pairs)


def parse_token_buckets(spec: str, what: str = "mixed_step_buckets") -> tuple[int, ...]:
    """``"512,576,640"`` (or ``""``: the default spread): token counts, each > 0. Raises a ValueError naming ``what``
    and the spec."""
    parts = [part.strip() for part in spec.split(",") if part.strip()]
    if not all(part.isdigit() and int(part) > 0 for part in parts):
        raise ValueError(f"{what} {spec!r}: expected token counts > 0 joined by ',', e.g. 256,512,768, or '' for "
                         f"the default spread")
    return tuple(sorted({int(part) for part in parts}))


@dataclass
class EngineConfig:
    """Everything the engine needs to start; defaults suit the embedded CPU model.

    Attributes:
        model_dir: Hugging Face checkpoint directory (config.json, *.safetensors,
            tokenizer.json).
        adapters: adapter name -> PEFT adapter directory (the catalogue).
        device: "cpu", "cuda" or "cuda:N".
        dtype: "auto" (float32 on CPU, bfloat16 on CUDA), "float32", "bfloat16", "float16".
        max_lora_rank: adapters of a larger rank are refused at registration.
        max_loras: distinct adapters in one batch at most.
        max_cpu_loras: adapters kept in the host-memory cache (None: unbounded).
        max_num_seqs: requests running at once.
        max_num_batched_tokens: tokens in one forward step (prefill chunks included).
        max_model_len: context length (prompt + output); None: the checkpoint's.
        page_size: tokens per KV-cache page.
        num_kv_pages: pages in the pool; None: sized from free memory.
        gpu_memory_fraction: share of free device memory the pool may take.
        max_queue_size: waiting requests beyond which new ones are refused (0: no limit).
        kernels: "auto" (Triton kernels for LoRA and decode attention on CUDA, torch on
            the CPU), "triton" or "torch".
        fuse_add_norm: on the kernel path, residual add + RMSNorm as one Triton kernel (off: torch ops).
        fuse_silu_mul: on the kernel path, the MLP's silu(gate) * up as one Triton kernel (off: torch ops).
        fuse_rope_kv: on the kernel path, each layer's q/k norm (Qwen3), rotary embedding and KV-cache write as one
            Triton kernel (off: torch ops).
        base_gemm: the base layers' GEMMs of steps of at most 128 tokens on the kernel path: "torch" (F.linear:
            cuBLAS) or "triton" (``kernels/skinny_gemm.py``; 0.93-1.08x of cuBLAS at 64 rows on the H200, 0.48-0.88x
            at 128, so opt-in); "auto": the Triton GEMM in CUDA-graph steps with adapters of at most 64 tokens,
            each LoRA shrink captured after its GEMM (``LoraBatch.fork``; the pair's decode step measured 1.2-7.6%
            faster than cuBLAS with the shrink first), cuBLAS everywhere else. Larger steps always take torch.
        decode_gemm_blas: the cuBLAS interface of the base GEMMs in captured decode steps: "cublaslt" (its GEMMs
            at 64 rows took 0.95x of cuBLAS's time over a layer on the H200) or "cublas" (torch's default).
        decode_gemm_sm_carveout: in captured decode steps with adapters, SMs the base GEMMs leave free for the LoRA
            kernels running beside them, whose shrinks are then captured after their GEMMs
            (``execution/decode_gemms.py``); cuBLASLt only; 0: none (the GEMMs fill the GPU); None: 32 of every 132
            SMs (the H200's measured setting, scaled to the device), 0 with "cublas".
        decode_gemm_group_carveouts: per projection group, the SMs its base GEMM leaves in place of
            ``decode_gemm_sm_carveout`` in those steps: "qkv=64/gate_up=16" (groups qkv, o, gate_up, down); "": none.
            qkv=64 halves the wait for the q/k/v LoRA kernels on the H200, but the step's gain was not established
            (0.98-1.03x of 32 SMs for every GEMM over three calls), so it is opt-in.
        prefill_attention: "sdpa" (each prefill chunk through torch's fused attention over its
            gathered cache) or "paged" (prefill tokens join the decode rows in the paged-attention
            kernel: one launch per layer for the whole step, no gathers; keys are re-read per query
            token, so long prompts cost more). Kernel path only.
        decode_lora_kernels: the LoRA kernels of steps under 64 tokens (the decode steps): "bgmv" (one
            program per token, each reading its adapter's rows), "sgmv" (tokens grouped by adapter, 16-token
            tiles reading each adapter's rows once; a CUDA-graph step builds the groups on the device, in tables
            of fixed shapes) or "hybrid" (the BGMV shrink and the SGMV expand). Kernel path only.
        cuda_graphs: replay decode steps from CUDA graphs (CUDA with Triton kernels only).
        mixed_step_graphs: with cuda_graphs, replay the other steps (prefill chunks, alone or with decodes) from
            CUDA graphs too, one per token bucket up to max_num_batched_tokens (dense bases; steps with a
            sequence past a sliding window run eagerly). Those steps then attend through the paged kernel and
            apply LoRA one program per token (BGMV), whatever prefill_attention says; their launches no longer
            cost host time. Off: such steps run eagerly (prefill_attention and the segmented LoRA kernels).
        mixed_step_buckets: the token counts the mixed-step graphs are captured for, comma-separated (each step is
            padded to the smallest that holds it; max_num_batched_tokens is always one); "": every 64 tokens up to
            512, then eight per doubling (execution/step_graphs.py ``token_buckets``). Fewer buckets start faster
            and keep fewer graphs; coarser ones pad steps with tokens the GEMMs compute for nothing.
        warmup: compile the kernels for a spread of step sizes at startup (CUDA only).
        allow_runtime_adapters: accept load/unload/replace of adapters while serving; off
            unless the environment sets MANYLORA_ALLOW_RUNTIME_ADAPTERS=1 (as vLLM gates it).
        adapter_load_workers: threads that read, check and pack adapters from disk. More threads
            load faster but compete with the engine thread for the GIL.
        adapter_load_processes: > 0: adapters are read, checked and packed in that many child
            processes (each packs into shared memory, which the engine maps without a copy), so
            loading neither holds the engine's GIL nor waits for its launches; the
            adapter_load_workers threads then only wait on them. 0: the threads load (gated while
            the engine launches a step on CUDA). None: on CUDA a quarter of the cores (1 to 4), on
            the CPU 0.
        host_cache_fraction: the host tier keeps at most this share of the memory available when
            the engine starts (and, with loader processes packing into /dev/shm, at most 80% of its
            room), least recently used out first, on top of max_cpu_loras; 0: no byte limit.
            Split between tensor-parallel ranks.
        rehash_adapters: hash every adapter file again at every load; by default a file whose
            (device, inode, size, mtime, ctime) is unchanged since registration is not re-hashed
            (any write changes its ctime), and one changed is hashed and refused on a mismatch.
        async_adapter_uploads: copy adapters from host memory into the pool on a worker thread (a
            side CUDA stream on a GPU) while steps go on; their requests join when the copy is done.
            Adapters of queued requests are also copied ahead into free pages.
        gil_switch_interval_us: the interpreter's thread switch interval (sys.setswitchinterval)
            while the engine runs; 0 leaves Python's 5 ms. Each Triton launch releases the GIL,
            and with loader threads busy the engine thread then waits up to one interval to get
            it back: at 5 ms an eager step's few hundred launches took seconds on the H200.
        admit_every_steps: while requests run, admit waiting ones only every N steps (1: every step);
            fewer mixed prefill steps leave more decode steps to the CUDA graphs, at some TTFT cost.
        tensor_parallel_size: GPUs one engine shards the base model over (Megatron; LoRA partitioned
            so it adds no communication: docs/tensor-parallel.md). Rank 0 runs in the engine, ranks
            1.. in worker processes on the next GPUs (NCCL), or all on the CPU (gloo). Dense
            Llama-family bases only; no CUDA graphs or warm-up yet when > 1.
        resolvers: where to look for adapters a request names but the catalogue lacks,
            comma-separated: dir:PATH, hf-cache:PATH, plugin:MODULE:FACTORY[:ARG]; "" = off.
        strict_adapters: a catalogue adapter that cannot be served (a pickle-only ``adapter_model.bin``, a missing
            directory, a rank above max_lora_rank, a pinned sha256 that does not match, ...) fails the engine's
            start with its error. Off: it is refused alone (a warning naming it, its path and the reason; listed
            with ``"status": "refused"`` and the reason; counted in ``stats()["adapters_refused"]``; requests
            naming it get NOT_FOUND with the reason) and every other adapter is served.
        list_adapter_paths: adapter listings and load / unload replies include each adapter's directory on the
            server (``"path"``); off: they leave it out, since any tenant may list adapters.
        stream_interval_ms: a streamed request's chunks are released at least this far apart (its first token at
            once, its last with the end): the tokens of the interval travel in one response. Each response costs
            the Triton stub the same whatever it holds, so one per token would cap the server far below the
            engine; 0: one response per token (as far as UTF-8 boundaries and stop strings allow).
        stream_responses_per_s: the streamed responses a second the running requests may make together; with
            more streams running than this allows at stream_interval_ms, each stream's interval grows to
            (streams running) / stream_responses_per_s. A path whose every response costs several process
            crossings (the `llm` ensemble: generator, ensemble step, postprocessing) then sends fewer, larger
            chunks under load, and per-token chunks when few streams run. 0: off (stream_interval_ms alone).
    """

    model_dir: str
    adapters: dict[str, str] = field(default_factory=dict)
    device: str = "cpu"
    dtype: str = "auto"
    max_lora_rank: int = 64
    max_loras: int = 32
    max_cpu_loras: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    page_size: int = 16
    num_kv_pages: int | None = None
    gpu_memory_fraction: float = 0.85
    max_queue_size: int = 0
    kernels: str = "auto"
    prefill_attention: str = "sdpa"
    decode_lora_kernels: str = "bgmv"
    fuse_add_norm: bool = True
    fuse_silu_mul: bool = True
    fuse_rope_kv: bool = True
    base_gemm: str = "torch"
    decode_gemm_blas: str = "cublaslt"
    decode_gemm_sm_carveout: int | None = None
    decode_gemm_group_carveouts: str = ""
    cuda_graphs: bool = True
    mixed_step_graphs: bool = True
    mixed_step_buckets: str = ""
    warmup: bool = True
    allow_runtime_adapters: bool = field(default_factory=lambda: _env_flag("MANYLORA_ALLOW_RUNTIME_ADAPTERS"))
    resolvers: str = ""
    adapter_load_workers: int = 2
    adapter_load_processes: int | None = None
    host_cache_fraction: float = 0.4
    gil_switch_interval_us: int = 100
    async_adapter_uploads: bool = True
    rehash_adapters: bool = False
    admit_every_steps: int = 1
    tensor_parallel_size: int = 1
    strict_adapters: bool = False
    list_adapter_paths: bool = False
    stream_interval_ms: float = 50.0
    stream_responses_per_s: float = 1500.0

    def __post_init__(self) -> None:
        positive = ("max_lora_rank", "max_loras", "max_num_seqs", "max_num_batched_tokens", "page_size",
                    "admit_every_steps", "adapter_load_workers", "tensor_parallel_size")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.adapter_load_processes is not None and self.adapter_load_processes < 0:
            raise ValueError(f"EngineConfig.adapter_load_processes must be >= 0 (or None: by device), got "
                             f"{self.adapter_load_processes}")
        if self.prefill_attention not in ("sdpa", "paged"):
            raise ValueError(
                f"EngineConfig.prefill_attention must be 'sdpa' or 'paged', got {self.prefill_attention!r}")
        check_decode_form_name(self.decode_lora_kernels, "EngineConfig.decode_lora_kernels")
        if self.base_gemm not in BASE_GEMMS:
            raise ValueError(f"EngineConfig.base_gemm must be one of {BASE_GEMMS}, got {self.base_gemm!r}")
        check_decode_gemm_settings(self.decode_gemm_blas, self.decode_gemm_sm_carveout)
        self._check_group_carveouts()
        parse_token_buckets(self.mixed_step_buckets, "EngineConfig.mixed_step_buckets")
        if not 0.0 <= self.host_cache_fraction <= 1.0:
            raise ValueError(f"EngineConfig.host_cache_fraction must be in [0, 1], got {self.host_cache_fraction}")
        if not 0.0 <= self.stream_interval_ms <= 10_000:
            raise ValueError(f"EngineConfig.stream_interval_ms must be in [0, 10000], got {self.stream_interval_ms}")
        if not 0.0 <= self.stream_responses_per_s <= 1e7:
            raise ValueError(f"EngineConfig.stream_responses_per_s must be in [0, 1e7] (0: off), got "
                             f"{self.stream_responses_per_s}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(f"EngineConfig.gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")

    def _check_group_carveouts(self) -> None:
        """Raise a ValueError naming ``decode_gemm_group_carveouts`` unless it parses and its counts are ones the
        chosen cuBLAS interface honours."""

        spec = self.decode_gemm_group_carveouts
        groups = parse_group_carveouts(spec, "EngineConfig.decode_gemm_group_carveouts")
        if any(sms for _, sms in groups) and self.decode_gemm_blas != "cublaslt":
            raise ValueError(f"EngineConfig.decode_gemm_group_carveouts={spec!r} needs decode_gemm_blas='cublaslt' "
                             f"(the cuBLAS interface ignores an SM target), got {self.decode_gemm_blas!r}")

    @classmethod
    def from_strings(cls, values: dict[str, str], **overrides: object) -> EngineConfig:
        """Build from string values (config.pbtxt parameters); unknown keys are an error."""
        known = {f.name: f for f in fields(cls)}
        kwargs: dict[str, object] = {}
        for key, raw in values.items():
            if key not in known:
                raise ValueError(f"unknown engine parameter '{key}'; known: {sorted(known)}")
            kwargs[key] = _parse(known[key].type, raw)
        kwargs.update(overrides)
        return cls(**kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ModelKernelOptions:
    """How the model's forward runs: EngineConfig's kernel-path knobs with ``kernels`` resolved for the device. The
    engine applies them to its model and hands them to tensor-parallel ranks, which apply them to theirs."""

    use_kernels: bool
    fuse_add_norm: bool = True
    fuse_silu_mul: bool = True
    fuse_rope_kv: bool = True
    base_gemm: str = "torch"

    @classmethod
    def of(cls, config: EngineConfig, use_kernels: bool) -> ModelKernelOptions:
        return cls(use_kernels=use_kernels, **{f.name: getattr(config, f.name) for f in fields(cls)
                                               if f.name != "use_kernels"})

    def apply_to(self, model: object) -> None:
        """Set the model's attributes of the same names (manylora/engine/models/llama.py LlamaModel)."""
        for f in fields(self):
            setattr(model, f.name, getattr(self, f.name))


def check_decode_form_name(name: str, what: str = "decode_lora_kernels") -> None:
    """Raise a ValueError naming ``what`` unless ``name`` is one of DECODE_FORMS."""
    if name not in DECODE_FORMS:
        raise ValueError(f"{what} must be one of {', '.join(DECODE_FORMS)}, got {name!r}")


def check_decode_gemm_settings(blas: str, sm_carveout: int | None, what: str = "EngineConfig") -> None:
    """Raise a ValueError naming the setting unless ``blas`` is one of DECODE_BLAS and ``sm_carveout`` is a count
    the chosen interface honours."""
    if blas not in DECODE_BLAS:
        raise ValueError(f"{what}.decode_gemm_blas must be one of {', '.join(DECODE_BLAS)}, got {blas!r}")
    if sm_carveout is None:
        return
    if sm_carveout < 0:
        raise ValueError(f"{what}.decode_gemm_sm_carveout must be >= 0, got {sm_carveout}")
    if sm_carveout and blas != "cublaslt":
        raise ValueError(f"{what}.decode_gemm_sm_carveout={sm_carveout} needs decode_gemm_blas='cublaslt' (the "
                         f"cuBLAS interface ignores an SM target), got {blas!r}")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _parse(type_name: object, raw: str) -> object:
    text = str(type_name)
    if raw.strip().lower() in ("", "none", "null") and "None" in text:
        return None
    if text.startswith("int"):
        return int(raw)
    if text.startswith("bool"):
        if raw.strip().lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
            raise ValueError(f"expected a boolean, got '{raw}'")
        return raw.strip().lower() in ("true", "1", "yes", "on")
    if text.startswith("float"):
        return float(raw)
    if text.startswith("dict"):
        raise ValueError("adapters are given as a catalogue file, not a parameter")
    return raw
