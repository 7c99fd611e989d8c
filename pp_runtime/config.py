"""Frozen, validated configuration dataclasses.

Each config is a small frozen dataclass checked in ``__post_init__``; a bad value
raises ``ValueError`` naming the field. Values derived at run time (number of KV
blocks, the paper's B, layer partitions) live in the objects that compute them,
never written back here.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field

from pp_runtime.field_checks import check_int, is_int

SCHEDULER_POLICIES = ("sarathi", "orca", "prefill_first", "request_level")
CHUNK_BUDGETS = ("flops", "tokens")
ADMISSIONS = ("fcfs", "longest_first")
KV_ADMISSIONS = ("reserve", "optimistic")
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _boolean(obj: object, *names: str) -> None:
    for name in names:  # "yes" / "no" would both be truthy
        if not isinstance(getattr(obj, name), bool):
            raise ValueError(f"{type(obj).__name__}.{name} must be true or false, got {getattr(obj, name)!r}")


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be a positive integer, got {value!r}")


class HeadSizes:
    """Attention widths derived from hidden_size, num_heads, num_kv_heads and head_dim (0:
    hidden_size // num_heads), and a layer's linear weights; one definition for ModelConfig and
    the simulator's SimModel."""

    gated_mlp = True  # LLaMA family (ModelConfig); SimModel's field can say otherwise

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_size

    @property
    def linear_params(self) -> int:
        """Weights of one layer's linear ops: QKV, O, the MLP's gate (if gated), up and down."""
        h = self.hidden_size
        mlp = 3 if self.gated_mlp else 2
        return h * (self.q_size + 2 * self.kv_size) + self.q_size * h + mlp * h * self.intermediate_size

    @property
    def key_cost(self) -> float:
        """A token's attention FLOPs per key it attends to (QKᵀ and PV: 4 × q_size), in units of
        its linear-layer FLOPs (2 × a layer's weights): what each cached token of context adds to
        the cost of a prompt token. SmolLM2-135M: 2 · 576 / 3,538,944 = 3.26e-4, so a chunk
        token at position 512 costs 1.17 tokens; LLaMA-7B: 4.1e-5."""
        return 2 * self.q_size / self.linear_params


@dataclass(frozen=True)
class ModelConfig(HeadSizes):
    """Shape of a LLaMA-family decoder (LLaMA 2/3, Mistral, Qwen2, SmolLM)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    # Layers attend to the last sliding_window tokens only (Mistral); attention here is exact
    # inside one window, so no sequence may be longer. None: full attention.
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"

    def __post_init__(self) -> None:
        _positive(self, "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "max_position_embeddings")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_kv_heads={self.num_kv_heads} must divide "
                             f"num_heads={self.num_heads}")
        if self.head_dim < 0 or (self.head_dim == 0 and self.hidden_size % self.num_heads):
            raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be given (> 0) when "
                             f"num_heads does not divide hidden_size")
        if self.rope_theta <= 0:
            raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta}")
        if self.sliding_window is not None and not (is_int(self.sliding_window) and self.sliding_window > 0):
            raise ValueError(f"ModelConfig.sliding_window must be a positive integer or None, got {self.sliding_window!r}")

    @property
    def max_len(self) -> int:
        """The longest sequence this runtime computes exactly: the positions, or one sliding window."""
        return min(self.max_position_embeddings, self.sliding_window or self.max_position_embeddings)

    def params_per_token_flops(self, lm_head: bool = True) -> int:
        """Parameters touched per token by the linear layers (FLOPs/token = 2 × this); without
        the LM head for tokens that are not sampled (non-final prefill positions)."""
        return self.num_layers * self.linear_params + (self.hidden_size * self.vocab_size if lm_head else 0)


def is_layer_count(n: object) -> bool:
    """A stage's share of the layers: a positive multiple of 0.5 (not a bool: ``true`` in YAML is a
    mistake, not 1)."""
    return isinstance(n, numbers.Real) and not isinstance(n, bool) and n > 0 and (2 * n) % 1 == 0


def are_step_costs(costs: object) -> bool:
    """SchedulerConfig.step_costs as given (a list or tuple): empty, or 3 finite numbers ≥ 0 (prompt
    key, decode row, decode key; not bools). The one rule the config, the flag, the run YAML and
    a simulated scenario check, each naming itself."""
    return isinstance(costs, (tuple, list)) and (not costs or len(costs) == 3 and all(
        isinstance(c, numbers.Real) and not isinstance(c, bool) and _finite_nonnegative(c) for c in costs))


def _finite_nonnegative(x: numbers.Real) -> bool:
    try:  # an int too large for a float (a YAML or JSON number of 400 digits) is not a cost either
        return 0 <= float(x) < float("inf")
    except OverflowError:
        return False


@dataclass(frozen=True)
class ParallelConfig:
    """pp stages × tp ranks; ``partition`` optionally gives the layer count of each stage.

    Counts may end in .5: a stage boundary then falls inside a layer, between its attention
    block and its MLP (e.g. 15.5, 14.5). The last stage also runs the LM head, which for a
    decode row costs several layers' linears on a large-vocabulary model: a whole layer moved
    off it can overshoot, half of one is a finer step."""

    pp: int = 1
    tp: int = 1
    partition: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        _positive(self, "pp", "tp")
        if self.partition is not None:
            if len(self.partition) != self.pp:
                raise ValueError(f"ParallelConfig.partition has {len(self.partition)} entries, pp={self.pp}")
            if not all(is_layer_count(n) for n in self.partition):
                raise ValueError("ParallelConfig.partition entries must be positive multiples of 0.5 "
                                 f"(layer counts, halves split a layer after its attention), got {list(self.partition)}")

    @property
    def world_size(self) -> int:
        return self.pp * self.tp

    def check_model(self, model: ModelConfig) -> None:
        """Raise ValueError when this split does not fit ``model``."""
        if self.partition is None and self.pp > model.num_layers:
            raise ValueError(f"pp={self.pp} exceeds the model's num_layers={model.num_layers}")
        if self.partition is not None and sum(self.partition) != model.num_layers:
            raise ValueError(f"partition {list(self.partition)} sums to {sum(self.partition)}, "
                             f"model has {model.num_layers} layers")
        # every TP-split dimension, checked before any worker loads a weight
        for name in ("num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
            if getattr(model, name) % self.tp:
                raise ValueError(f"tp={self.tp} does not divide the model's {name}={getattr(model, name)}")

    def stage_units(self, num_layers: int) -> list[tuple[int, int]]:
        """[start, end) per stage in half-layer units: unit 2i is layer i's attention block, 2i + 1
        its MLP. Without a partition: whole layers, an even split with the remainder spread over
        the first stages."""
        if self.partition is not None:
            sizes = [round(2 * n) for n in self.partition]
        else:
            base, extra = divmod(num_layers, self.pp)
            sizes = [2 * (base + (1 if s < extra else 0)) for s in range(self.pp)]
        ranges, start = [], 0
        for n in sizes:
            ranges.append((start, start + n))
            start += n
        return ranges


@dataclass(frozen=True)
class SchedulerConfig:
    """What goes into each micro-batch.

    chunk_size: the prefill chunk C (sarathi) and the token cap of prefill-only batches.
    max_batch_size: most sequences in one micro-batch.
    max_running: most requests running (holding KV) at once; 0 means max_batch_size. With pp
      micro-batches in flight, pp × max_batch_size lets every one of them be full — the
      paper's TP-PP setup (27 per micro-batch, 8 in flight); capping the running set at one
      micro-batch's worth starves a pipeline of decodes.
    tile_align: sarathi chunk = C − num_decodes, so each batch holds exactly C tokens.
    chunk_budget: what sarathi's budget C counts. "tokens": prompt tokens, as SARATHI does.
      "flops" (default): their FLOPs, attention included — a chunk costs at most what a fresh
      chunk of C tokens costs, so a chunk deeper into its prompt, whose tokens each attend to
      more keys, takes fewer of them (SmolLM2: 221 at position 512). Every micro-batch then
      takes about as long, and a pipeline stage does not wait for its neighbour's longer one:
      at pp = 2 on 96 P:D = 10 Zipf requests the stages' idle time fell by ~35% in a paired
      run (docs/BENCHMARKS.md). Needs the model's ``key_cost`` (the Scheduler's); without it the two
      are the same.
    admission: the order waiting requests start in. "fcfs" (default): arrival order.
      "longest_first": most max_tokens first, ties in arrival order (the LPT rule for makespan):
      each decode token costs a pass through the pipeline whatever pp is, so the longest decodes
      set a batch's end; started first, they finish while later prompts still give the
      micro-batches chunks to ride on, instead of decoding alone in few-row micro-batches after
      the last prompt (pp = 2, 48 P:D = 10 Zipf requests: docs/BENCHMARKS.md, target 4). A
      preempted request keeps its place at the head of the queue either way.
    step_costs: measured costs for the "flops" budget in a pipeline, in fresh prompt tokens (a
      prompt token's linear layers = 1): (per key a prompt token attends to, per decode row, per
      key a decode attends to), as ``pp_runtime.cost_fit`` fits them to a run's step times. Empty
      (default): the model's FLOPs key cost, decodes uncharged. Set, and with more than one
      micro-batch in flight, sarathi's micro-batches are equal in measured cost: the chunk gets
      what the decodes beside it leave of a fresh C-token chunk's cost (at least one token's).
      A pipeline's stages wait on each other's unequal steps, and the FLOPs budget left them
      unequal: it does not count the decodes (on this CPU 2–3 tokens' time each at ~700 keys,
      their attention reading K/V far below the FLOP rate) and prices a prompt key at 0.6 of its
      measured time (int8 + fp8 K/V; docs/BENCHMARKS.md, target 4). One micro-batch in flight
      waits on nobody: unchanged there.
    kv_admission: when a waiting request may take KV blocks. "optimistic" (vLLM's, the
      default): when its prompt fits the free blocks now; a running request that later finds no
      block for its next token preempts the newest idle one, which is recomputed later.
      "reserve" (TGI's): only while every running request's whole length (prompt + max_tokens)
      still fits the cache beside its own, so nothing is ever preempted; blocks a prompt shares
      through prefix caching are counted once. Where memory binds, reserve runs fewer requests
      at once and the rest wait: on this CPU about the same tokens/s as optimistic (its
      recomputation against reserve's narrower batches), TTFT p50 ×12–20 (docs/BENCHMARKS.md,
      twenty-second session).
    """

    policy: str = "sarathi"
    chunk_size: int = 256
    max_batch_size: int = 32
    tile_align: bool = False
    max_model_len: int = 2048
    max_running: int = 0
    chunk_budget: str = "flops"
    admission: str = "fcfs"
    step_costs: tuple[float, ...] = ()
    kv_admission: str = "optimistic"

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULER_POLICIES:
            raise ValueError(f"SchedulerConfig.policy must be one of {', '.join(SCHEDULER_POLICIES)}, "
                             f"got {self.policy!r}")
        if self.chunk_budget not in CHUNK_BUDGETS:
            raise ValueError(f"SchedulerConfig.chunk_budget must be one of {', '.join(CHUNK_BUDGETS)}, "
                             f"got {self.chunk_budget!r}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"SchedulerConfig.admission must be one of {', '.join(ADMISSIONS)}, "
                             f"got {self.admission!r}")
        if self.kv_admission not in KV_ADMISSIONS:
            raise ValueError(f"SchedulerConfig.kv_admission must be one of {', '.join(KV_ADMISSIONS)}, "
                             f"got {self.kv_admission!r}")
        _positive(self, "chunk_size", "max_batch_size", "max_model_len")
        if self.max_running < 0:
            raise ValueError(f"SchedulerConfig.max_running must be ≥ 0 (0: max_batch_size), got {self.max_running}")
        if not are_step_costs(self.step_costs):
            raise ValueError("SchedulerConfig.step_costs must be empty or 3 finite numbers ≥ 0 (prompt key, "
                             f"decode row, decode key), got {self.step_costs!r}")
        object.__setattr__(self, "step_costs", tuple(self.step_costs))  # a list (from JSON, YAML) compares equal to none
        _boolean(self, "tile_align")
        if self.policy == "sarathi" and self.tile_align and self.chunk_size < self.max_batch_size:
            raise ValueError(f"SchedulerConfig.chunk_size={self.chunk_size} must be ≥ max_batch_size="
                             f"{self.max_batch_size} with tile_align (decodes alone would exceed C)")

    @property
    def running_cap(self) -> int:
        return self.max_running or self.max_batch_size


# "fp8" is vLLM's name for the OCP float8 e4m3 format (torch.float8_e4m3fn) without a scale
KV_DTYPES = ("auto", "float16", "fp8")
KV_BYTES = {"float16": 2, "fp8": 1}


def check_kv_dtype(kv_dtype: str, device: str, dtype: str) -> None:
    """ValueError unless the KV cache dtype suits the model's. On CPU, float16 and fp8 are for fp32
    models, whose kernels widen them as they read. On CUDA, either is for a model whose K/V it
    makes smaller (fp8 halves a bf16 model's, as vLLM's ``--kv-cache-dtype fp8``): the Triton
    kernels write and read it, SDPA gets it widened."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be {' or '.join(KV_DTYPES)}, got {kv_dtype!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if kv_dtype == "auto":
        return
    if device != "cuda" and dtype != "float32":
        raise ValueError(f"kv_cache_dtype {kv_dtype} is for float32 models on CPU (got --device {device} --dtype "
                         f"{dtype}: there the cache takes the model's dtype; use auto)")
    if device == "cuda" and DTYPE_BYTES[dtype] <= KV_BYTES[kv_dtype]:
        raise ValueError(f"kv_cache_dtype {kv_dtype} is no smaller than a {dtype} model's K/V on CUDA "
                         f"(use fp8, or auto)")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: ``block_size`` tokens per block.

    memory_budget_bytes is the paper's M_G per worker: weights (M_S) come out of it and the
    rest holds KV blocks. On CUDA, None means 90% of the device's memory.

    kv_dtype: "auto" stores K/V in the model's dtype; "float16" halves them for an fp32 model
    (CPU or CUDA) — twice the tokens in the same budget, and half the bytes that decode attention
    (bound by reading K/V) streams. "fp8" (float8 e4m3, vLLM's name; no scale: values clamped to
    ±448, 3 mantissa bits) halves them again, and halves a bf16 or fp16 model's on CUDA. Values
    are rounded once when written; attention still computes in fp32 (the CPU kernels, CUDA's
    decode kernel) or in the model's dtype (SDPA on CUDA, the cache widened to it).

    prefault: on CPU the cache is allocated as zero pages that the OS faults in (and zeroes) when
    a block is first written, so a process's first run pays for that: 2-8% of its throughput on
    the project's box. True writes every page at allocation (about a second per GiB) so that runs
    measured from the first one (``pp-runtime bench``'s schedulers) are all warm.

    enable_prefix_caching: vLLM's automatic prefix caching (pp_runtime/kv_cache.py): a prompt
    that starts with whole blocks some earlier request computed (a system prompt, few-shot
    examples, a conversation's history) shares their K/V and prefills only the rest; the blocks
    stay cached across runs of one LLM until their room is needed. On by default, as in vLLM:
    without shared prefixes it costs the driver a hash a block (0.99 of the throughput without
    it, 6 paired rounds; docs/BENCHMARKS.md). A benchmark that runs the same prompts again on one
    LLM turns it off (or resets it): its second run would find every prompt cached.
    """

    block_size: int = 16
    memory_budget_bytes: int | None = 4 << 30
    kv_dtype: str = "auto"
    prefault: bool = False
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _positive(self, "block_size")
        if self.memory_budget_bytes is not None:
            _positive(self, "memory_budget_bytes")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"CacheConfig.kv_dtype must be {' or '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        _boolean(self, "prefault", "enable_prefix_caching")


GGUF_WEIGHTS = ("native", "dequantize")
# torch.set_float32_matmul_precision's names: "highest" sums fp32 products of fp32 inputs;
# "medium" lets them take bf16 inputs (fp32 sums), which the CPU GEMM does where AVX512-BF16 is,
# and so does the prefill attention's two products. Ours beside them: "int8" rounds x to int8 per
# block of 32 against GGUF weights' own codes (llama.cpp's scheme), where the CPU has AVX512-VNNI
# (or AVX2, for Q4_0/Q4_1 weights), its attention as under "medium"
MATMUL_PRECISIONS = ("highest", "medium", "int8")


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "cpu"
    dtype: str = "float32"
    attention: str = "auto"
    threads: int = 0  # torch threads per worker; 0 leaves torch's default (a Ray actor: 1, its one reserved CPU)
    # GGUF Q4_0/Q4_1/Q8_0 matrices: "native" keeps the stored blocks (fp32 on CPU: the GEMM
    # dequantizes them on the fly, bit-identical weights, ~1/5 of the bytes); "dequantize" loads floats
    gguf_weights: str = "native"
    # "medium": fp32 products of more than 12 rows (prefill chunks, decode-only batches of 13+
    # sequences) on bf16-rounded x and W with fp32 sums, by AVX512-BF16 dot products (~1.6x the
    # fp32 GEMM at 256 rows here); products of up to 12 rows stay fp32. "int8": every linear whose
    # weight is GGUF Q4_0/Q4_1/Q8_0 kept native takes int8 products (x's blocks of 32 rounded to
    # int8 codes with one scale each, exact int32 sums; ~2x the fp32 GEMM at every row count on a
    # core with AVX512-VNNI; on an AVX2 core Q4_0/Q4_1 weights only, 1.6-2.4x); elsewhere both compute
    # as "highest"
    matmul_precision: str = "highest"
    # CUDA only: decode-only steps padded to a few batch sizes and replayed as captured CUDA
    # graphs (stages/cuda_graphs.py). None, vLLM's default: on where the worker finds CUDA, the
    # torch attention backend and tp 1 (on an H200 a LLaMA-7B decode-only step of 4 rows ran
    # 12.3 -> 5.1 ms, 64 rows 13.2 -> 10.7; NCCL's all-reduce under capture is unmeasured, so a
    # TP worker replays only when asked: True); False: never
    cuda_graphs: bool | None = None

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"DeviceConfig.device must be cpu or cuda, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"DeviceConfig.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.attention not in ("torch", "xformers", "auto"):
            raise ValueError(f"DeviceConfig.attention must be torch, xformers or auto, got {self.attention!r}")
        check_int("DeviceConfig.threads", self.threads, 0)
        if self.gguf_weights not in GGUF_WEIGHTS:
            raise ValueError(f"DeviceConfig.gguf_weights must be {' or '.join(GGUF_WEIGHTS)}, got {self.gguf_weights!r}")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(f"DeviceConfig.matmul_precision must be one of {', '.join(MATMUL_PRECISIONS)}, "
                             f"got {self.matmul_precision!r}")
        if self.matmul_precision != "highest" and (self.device, self.dtype) != ("cpu", "float32"):
            raise ValueError(f"DeviceConfig.matmul_precision {self.matmul_precision} is for float32 models on CPU (got device "
                             f"{self.device}, dtype {self.dtype})")
        if self.cuda_graphs is not None:
            _boolean(self, "cuda_graphs")
        if self.cuda_graphs and self.device != "cuda":
            raise ValueError(f"DeviceConfig.cuda_graphs needs device cuda, got {self.device!r}")
        if self.cuda_graphs and self.attention == "xformers":
            raise ValueError("DeviceConfig.cuda_graphs needs attention torch or auto (xformers builds its mask on the "
                             "host each step), got 'xformers'")


@dataclass(frozen=True)
class EngineConfig:
    """Everything a run needs, grouped; ``model_path`` is resolved by stages.model_source."""

    model_path: str
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        # every unseeded request's sampler is seeded from this (torch.Generator.manual_seed: an int)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"EngineConfig.seed must be an integer, got {self.seed!r}")
