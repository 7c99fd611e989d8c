"""The `pp-runtime` argument parser and its mapping onto LLM's keyword arguments.

    args = build_parser().parse_args(["generate", "--model", "llama-tiny", "--pp", "2", "--prompt", "hi"])
    LLM(**engine_kwargs(args))
"""
from __future__ import annotations

import argparse
import sys

from pp_runtime.config import (ADMISSIONS, CHUNK_BUDGETS, DTYPES, GGUF_WEIGHTS, KV_ADMISSIONS, KV_DTYPES,
                               MATMUL_PRECISIONS, SCHEDULER_POLICIES, are_step_costs)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse's default prints usage too)
        print(f"pp-runtime: error: {message}", file=sys.stderr)
        sys.exit(2)


MATMUL_HELP = ("highest: fp32 products; medium: products of > 12 rows (prefill chunks, decode batches of 13+) "
               "on bf16-rounded inputs with fp32 sums where the CPU has AVX512-BF16, ~1.6x faster linears at "
               "256 rows; int8: GGUF Q4/Q8 linears on int8-rounded inputs (per block of 32) against the "
               "weights' own codes where the CPU has AVX512-VNNI (AVX2: Q4 weights), ~2x faster linears (fp32 models on CPU)")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _positive_int(text: str) -> int:
    v = _int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return v


def _nonnegative_int(text: str) -> int:
    v = _int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be ≥ 0, got {v}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0 or v == float("inf"):  # `not >` also catches nan
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return v


def _step_costs(text: str) -> tuple[float, ...] | str:
    """'fit', or three numbers ≥ 0 comma separated (prompt key, decode row, decode key)."""
    if text == "fit":
        return text
    try:
        costs = tuple(float(x) for x in text.split(","))
    except ValueError:
        costs = ()
    if len(costs) != 3 or not are_step_costs(costs):
        raise argparse.ArgumentTypeError(f"expected 'fit' or 3 numbers ≥ 0 (prompt key,decode row,decode key), got {text!r}")
    return costs


def add_engine_args(p: argparse.ArgumentParser, overrides: bool = False) -> None:
    """The engine flags. overrides=True (bench): every default is None, so that only the flags
    given on the command line replace the config file's values."""
    add_engine_args_to(p)
    if overrides:
        for action in p._actions:
            if action.dest not in ("help", "quiet"):
                action.default = None
    p.add_argument("--run-dir", default=None,
                   help="bench: the same as --out (one run directory per scheduler under it)" if overrides else
                   "write the run directory (timings, summary, trace, results) here")


def add_engine_args_to(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder, .gguf file or preset (default smollm2-135m)")
    p.add_argument("--pp", type=_positive_int, default=1, help="pipeline stages")
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel ranks per stage")
    p.add_argument("--partition", default=None, help="layers per stage, comma separated (e.g. 16,14; 15.5,14.5 cuts a layer after its attention)")
    p.add_argument("--launcher", choices=("local", "ray", "torchrun"), default=None)
    p.add_argument("--scheduler", choices=SCHEDULER_POLICIES, default="sarathi")
    p.add_argument("--chunk-size", type=_positive_int, default=256)
    p.add_argument("--max-batch-size", type=_positive_int, default=None,
                   help="sequences per micro-batch (default 64, or C with sarathi's --tile-align); pp× as many "
                        "may run at once")
    p.add_argument("--tile-align", action="store_true", help="chunk = C − decodes: every batch is C tokens")
    p.add_argument("--chunk-budget", choices=CHUNK_BUDGETS, default="flops",
                   help="what sarathi's --chunk-size counts: flops (default: attention included, so a chunk deep "
                        "into a long prompt takes fewer tokens and every micro-batch takes about as long) or "
                        "tokens (SARATHI's plain token budget)")
    p.add_argument("--step-costs", type=_step_costs, default=(), metavar="fit|KEY,ROW,DKEY",
                   help="in a pipeline, sarathi's micro-batches of equal measured cost (FLOPs budget): what a "
                        "prompt key, a decode row and a decode key cost, in fresh prompt tokens; fit: measure "
                        "them at start-up on a synthetic Zipf run (seconds; the values are printed for reuse); "
                        "default none: the FLOPs budget alone, decodes uncharged. Measured with --admission "
                        "longest_first (+4-8%% tokens/s at pp=2); under fcfs they cost 1-4%%")
    p.add_argument("--admission", choices=ADMISSIONS, default="fcfs",
                   help="the order waiting requests start in: fcfs (default, arrival order) or longest_first "
                        "(most max_tokens first: the longest decodes start early and finish beside later "
                        "prompts' chunks, a shorter batch end to end)")
    p.add_argument("--kv-admission", choices=KV_ADMISSIONS, default="optimistic",
                   help="when a waiting request may start: optimistic (default, vLLM's: once its prompt "
                        "fits the free KV blocks now, preempting the newest when blocks run out and "
                        "recomputing it later) or reserve (once every running request's prompt + max_tokens - 1 "
                        "tokens fit the KV cache beside its own: never a preemption, but where memory binds fewer "
                        "run at once and the rest wait: TTFT p50 up to 20x)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share the K/V of whole blocks of prompt that an earlier request computed (a system "
                        "prompt, few-shot examples): only the rest is prefilled (vLLM's automatic prefix caching; "
                        "on by default, as in vLLM; --no-enable-prefix-caching turns it off)")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="on CUDA, replay decode-only steps as captured CUDA graphs, padded to a few batch sizes "
                        "(the host issues a step's kernels once per shape, not per step). Default, as vLLM's: on "
                        "with CUDA, torch attention and tp 1; --no-cuda-graphs runs every step eagerly")
    p.add_argument("--attention", choices=("torch", "xformers", "auto"), default="auto")
    p.add_argument("--memory-budget-gb", type=_positive_float, default=None,
                   help="M_G per worker (CPU default 4)")
    p.add_argument("--block-size", type=_positive_int, default=16)
    p.add_argument("--max-model-len", type=_positive_int, default=None)
    p.add_argument("--threads", type=_nonnegative_int, default=0, help="torch threads per worker (0: torch's default in local and torchrun workers, 1 in a Ray actor, which reserves one CPU whatever this is)")
    p.add_argument("--gguf-weights", choices=GGUF_WEIGHTS, default="native",
                   help="GGUF Q4_0/Q4_1/Q8_0 matrices: keep the stored blocks (CPU fp32 GEMM dequantizes "
                        "on the fly, same weights) or load them as floats")
    p.add_argument("--kv-cache-dtype", choices=KV_DTYPES, default="auto",
                   help="auto: the model's dtype; float16: half the KV bytes of an fp32 model "
                        "(twice the tokens per budget, faster long-context decode; values rounded once); "
                        "fp8: float8 e4m3 as vLLM's, a quarter of the fp32 bytes, on CUDA also half a bf16 "
                        "model's (values clamped to +-448, 3 mantissa bits); on CPU only for float32 models")
    p.add_argument("--matmul-precision", choices=MATMUL_PRECISIONS, default="highest", help=MATMUL_HELP)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pp-runtime", description="pipeline-parallel LLM inference (SARATHI)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="generate for JSONL requests or --prompt texts")
    add_engine_args(g)
    g.add_argument("--input", help="JSONL requests (DESIGN.md §3.3); - reads standard input")
    g.add_argument("--output", help="JSONL results; - for stdout (default: stdout, with --prompt text on stdout)")
    g.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template to --prompt")
    g.add_argument("--max-tokens", type=_positive_int, default=64, help="default max_tokens")
    g.add_argument("--n", type=int, default=1,
                   help="default n: samples of each prompt (needs --temperature > 0; --prompt prints each)")
    g.add_argument("--temperature", type=float, default=0.0, help="default temperature")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--logprobs", type=int, default=None,
                   help="default logprobs: each new token's log-probability and this many likeliest alternatives (0-20)")
    g.add_argument("--min-tokens", type=int, default=0, help="default min_tokens: no stop before this many tokens")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="default presence_penalty (-2 to 2)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="default frequency_penalty (-2 to 2)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="default repetition_penalty (> 0; 1: off)")
    b = sub.add_parser("bench", help="run a workload under each scheduler of a configs/runs/*.yaml")
    b.add_argument("--config", required=True,
                   help="run config: a YAML path, or a name from configs/runs/ (pp2_zipf)")
    b.add_argument("--out", default=None, help="output directory (default runs/<config name>)")
    b.add_argument("--schedulers", default=None, help="comma-separated subset/override of the config's list")
    add_engine_args(b, overrides=True)
    r = sub.add_parser("report", help="plots (PNG) from run, bench or profile directories")
    r.add_argument("dirs", nargs="+")
    r.add_argument("--out", default=None, help="where combined plots go (default: the first directory)")
    window = r.add_mutually_exclusive_group()
    window.add_argument("--window-mbs", type=_positive_int, default=None,
                        help="Gantt window: the first N stage-0 micro-batches (default 40)")
    window.add_argument("--window-s", type=_positive_float, default=None, help="Gantt window: the first S seconds")
    sm = sub.add_parser("simulate", help="cluster-scale simulation with the real scheduler (configs/sim/*.yaml)")
    sm.add_argument("--config", required=True,
                    help="simulation config: a YAML path, or a name from configs/sim/ (fig12)")
    sm.add_argument("--out", default=None, help="output directory (default runs/sim_<config name>)")
    sm.add_argument("--quiet", action="store_true")
    pr = sub.add_parser("profile", help="per-operation times of prefill, decode and mixed batches")
    pr.add_argument("--model", default=None)
    pr.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    pr.add_argument("--dtype", choices=DTYPES, default="float32")
    pr.add_argument("--attention", choices=("torch", "xformers", "auto"), default="auto")
    pr.add_argument("--threads", type=_nonnegative_int, default=0)
    pr.add_argument("--kv-cache-dtype", choices=KV_DTYPES, default="auto")
    pr.add_argument("--matmul-precision", choices=MATMUL_PRECISIONS, default="highest", help=MATMUL_HELP)
    pr.add_argument("--grid", default="default",
                    help="default, quick, or overrides such as 'decode=1,4,16;context=768;prefill=' "
                         "(stages/profile.py: parse_grid)")
    pr.add_argument("--out", required=True)
    pr.add_argument("--colocate", type=_positive_int, default=1,
                    help="run N identical profiles at once (this one plus N-1 siblings writing OUT/colocated-K), "
                         "so the figures include the memory and core contention of N co-located stage workers")
    pr.add_argument("--quiet", action="store_true")
    pr.add_argument("--barrier", nargs=2, metavar=("DIR", "N"), default=None, help=argparse.SUPPRESS)
    dep = pr.add_argument_group("in a deployment", "with --pp/--tp > 1 or --launcher, every stage worker of a "
                                "deployment times its own layers through the real path, stages concurrently; "
                                "OUT/stage-K/profile.csv per stage (pp_runtime/profile_deploy.py)")
    dep.add_argument("--pp", type=_positive_int, default=1, help="pipeline stages")
    dep.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel ranks per stage")
    dep.add_argument("--partition", default=None, help="layers per stage, comma separated (e.g. 16,14; 15.5,14.5 cuts a layer after its attention)")
    dep.add_argument("--launcher", choices=("local", "ray", "torchrun"), default=None)
    dep.add_argument("--memory-budget-gb", type=_positive_float, default=None, help="M_G per worker (CPU default 4)")
    return parser


def parse_partition(text: str | None) -> list[float] | None:
    """"16,14" or "15.5,14.5" (a half splits a layer after its attention block); LLM's config
    turns whole numbers back into ints."""
    if not text:
        return None
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--partition must be comma-separated layer counts, got {text!r}") from None


def engine_kwargs(a: argparse.Namespace) -> dict:
    partition = parse_partition(a.partition)
    return dict(model=a.model, pp=a.pp, tp=a.tp, launcher=a.launcher, scheduler=a.scheduler,
                chunk_size=a.chunk_size, max_batch_size=a.max_batch_size, tile_align=a.tile_align,
                chunk_budget=a.chunk_budget, admission=a.admission, kv_admission=a.kv_admission,
                step_costs=a.step_costs,
                enable_prefix_caching=a.enable_prefix_caching, cuda_graphs=a.cuda_graphs,
                dtype=a.dtype, device=a.device, attention=a.attention, seed=a.seed, block_size=a.block_size,
                memory_budget_gb=a.memory_budget_gb, max_model_len=a.max_model_len, partition=partition,
                threads=a.threads, gguf_weights=a.gguf_weights, kv_cache_dtype=a.kv_cache_dtype,
                matmul_precision=a.matmul_precision, verbose=not a.quiet)
