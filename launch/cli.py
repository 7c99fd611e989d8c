"""`pp-runtime` command line (DESIGN.md §3.1); ``python -m launch.cli`` is the same.

    pp-runtime generate --prompt "What is the capital of France?" --chat
    pp-runtime generate --model llama-tiny --input in.jsonl --output out.jsonl --pp 2

Ctrl-C (SIGINT) or SIGTERM stops a run: the results so far are written (the unfinished
requests with finish_reason "cancelled"), the workers are killed, and the exit status is
130 or 143.
"""
from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from pp_runtime.config import CHUNK_BUDGETS, DTYPES, GGUF_WEIGHTS, KV_DTYPES, MATMUL_PRECISIONS, SCHEDULER_POLICIES


class _Interrupts:
    """SIGINT and SIGTERM raise KeyboardInterrupt in the main thread: the run under way stops
    between any two steps, cancels its unfinished requests and kills its workers (LLM.run), and
    the command writes what it has. The signal is remembered here because Ray's ray.get re-raises
    a plain KeyboardInterrupt, so the exception cannot say which one it was. Repeats within
    FORCE_AFTER_S are ignored: writing results and killing workers takes a moment, and a second
    Ctrl-C in the middle would leave orphans; a later one forces its way out."""

    FORCE_AFTER_S = 10.0

    def __init__(self) -> None:
        self.signum: int | None = None
        self._first = 0.0
        self._saved: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():  # signal.signal would refuse
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._saved[sig] = signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        """main() runs in-process in tests: leave the handlers as they were."""
        for sig, handler in self._saved.items():
            if handler is not None:  # None: installed outside Python, nothing to put back
                signal.signal(sig, handler)
        self._saved = {}

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.signum is not None and time.monotonic() - self._first < self.FORCE_AFTER_S:
            return
        self.signum, self._first = signum, time.monotonic()
        raise KeyboardInterrupt(signal.Signals(signum).name)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "KeyboardInterrupt"

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGINT)  # the shell's convention: 130, 143


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse's default prints usage too)
        print(f"pp-runtime: error: {message}", file=sys.stderr)
        sys.exit(2)


MATMUL_HELP = ("highest: fp32 products; medium: products of > 12 rows (prefill chunks, decode batches of 13+) "
               "on bf16-rounded inputs with fp32 sums where the CPU has AVX512-BF16, ~1.6x faster linears at "
               "256 rows (fp32 models on CPU)")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return v


def _nonnegative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
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
                   help="sequences per micro-batch (default: the paper's B / pp, capped at 64); pp× as many may run at once")
    p.add_argument("--tile-align", action="store_true", help="chunk = C − decodes: every batch is C tokens")
    p.add_argument("--chunk-budget", choices=CHUNK_BUDGETS, default="flops",
                   help="what sarathi's --chunk-size counts: flops (default: attention included, so a chunk deep "
                        "into a long prompt takes fewer tokens and every micro-batch takes about as long) or "
                        "tokens (SARATHI's plain token budget)")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--attention", choices=("torch", "xformers", "auto"), default="auto")
    p.add_argument("--memory-budget-gb", type=_positive_float, default=None,
                   help="M_G per worker (CPU default 4)")
    p.add_argument("--block-size", type=_positive_int, default=16)
    p.add_argument("--max-model-len", type=_positive_int, default=None)
    p.add_argument("--threads", type=_nonnegative_int, default=0, help="torch threads per worker (0: torch default)")
    p.add_argument("--gguf-weights", choices=GGUF_WEIGHTS, default="native",
                   help="GGUF Q4_0/Q4_1/Q8_0 matrices: keep the stored blocks (CPU fp32 GEMM dequantizes "
                        "on the fly, same weights) or load them as floats")
    p.add_argument("--kv-cache-dtype", choices=KV_DTYPES, default="auto",
                   help="auto: the model's dtype; float16: half the KV bytes of an fp32 model on CPU "
                        "(twice the tokens per budget, faster long-context decode; values rounded once)")
    p.add_argument("--matmul-precision", choices=MATMUL_PRECISIONS, default="highest", help=MATMUL_HELP)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pp-runtime", description="pipeline-parallel LLM inference (SARATHI)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="generate for JSONL requests or --prompt texts")
    add_engine_args(g)
    g.add_argument("--input", help="JSONL requests (DESIGN.md §3.3); - reads standard input")
    g.add_argument("--output", help="JSONL results (default: stdout; with --prompt, text on stdout)")
    g.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template to --prompt")
    g.add_argument("--max-tokens", type=_positive_int, default=64, help="default max_tokens")
    g.add_argument("--temperature", type=float, default=0.0, help="default temperature")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    b = sub.add_parser("bench", help="run a workload under each scheduler of a configs/runs/*.yaml")
    b.add_argument("--config", required=True, help="run config (configs/runs/*.yaml)")
    b.add_argument("--out", default=None, help="output directory (default runs/<config name>)")
    b.add_argument("--schedulers", default=None, help="comma-separated subset/override of the config's list")
    add_engine_args(b, overrides=True)
    r = sub.add_parser("report", help="plots (PNG) from run, bench or profile directories")
    r.add_argument("dirs", nargs="+")
    r.add_argument("--out", default=None, help="where combined plots go (default: the first directory)")
    sm = sub.add_parser("simulate", help="cluster-scale simulation with the real scheduler (configs/sim/*.yaml)")
    sm.add_argument("--config", required=True)
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
                chunk_budget=a.chunk_budget,
                dtype=a.dtype, device=a.device, attention=a.attention, seed=a.seed, block_size=a.block_size,
                memory_budget_gb=a.memory_budget_gb, max_model_len=a.max_model_len, partition=partition,
                threads=a.threads, gguf_weights=a.gguf_weights, kv_cache_dtype=a.kv_cache_dtype,
                matmul_precision=a.matmul_precision, verbose=not a.quiet)


def cmd_generate(a: argparse.Namespace) -> int:
    from pp_runtime.jsonl import read_requests, write_results
    from pp_runtime.llm import LLM
    from pp_runtime.run_outputs import RunInterrupted
    # Every check that needs no model runs before the model loads (seconds for real weights).
    if bool(a.input) == bool(a.prompt):
        raise ValueError("give either --input FILE or --prompt TEXT")
    if a.input and a.input != "-" and not Path(a.input).is_file():
        raise ValueError(f"--input {a.input}: no such file" if not Path(a.input).exists()
                         else f"--input {a.input}: not a file")
    if a.chat and not a.prompt:
        raise ValueError("--chat applies to --prompt texts")
    _check_writable("--output", a.output, is_dir=False)
    _check_writable("--run-dir", a.run_dir, is_dir=True)
    defaults = sampling_defaults(a)
    lines = read_requests(a.input, defaults) if a.input else None
    tok = prompts = None
    if lines is None:  # texts are tokenized up front: a model without a tokenizer is a usage error
        tok = _tokenizer(a.model)
        prompts = [_chat(tok, t) if a.chat else tok.encode(t) for t in a.prompt]
    with LLM(**engine_kwargs(a)) as llm:
        if a.run_dir:  # now, not at the end: a run killed half-way still names its worker processes
            _write_workers(Path(a.run_dir), llm.workers_info())
        if prompts is not None:
            reqs = [llm.make_request(f"prompt{i}", ids, defaults) for i, ids in enumerate(prompts)]
        else:
            reqs = [llm.make_request(x.request_id, x.prompt, x.params, x.error) for x in lines]
        interrupted = None
        try:
            outs = llm.run(reqs, progress=not a.quiet)
        except RunInterrupted as e:  # write what finished (and what did not), then leave as interrupted
            outs, interrupted = e.outputs, e
        if lines is None:
            for o in outs:
                if o.finish_reason != "error":
                    o.text = tok.decode(o.token_ids)
        rows = [o.to_json() for o in outs]
        if a.run_dir:
            from pp_runtime.rundir import write_run_dir
            if not llm.broken:  # timings live on the workers; a dead one has none to give
                write_run_dir(a.run_dir, llm)
            if lines is None or llm.broken:  # keep the decoded texts next to the tokens
                Path(a.run_dir).mkdir(parents=True, exist_ok=True)
                write_results(str(Path(a.run_dir) / "results.jsonl"), rows)
        if a.output:
            try:
                write_results(a.output, rows)
            except OSError as e:  # checked at start, but the disk may fill or the path go away
                for r in rows:  # the run's results, on stdout rather than lost
                    print(json.dumps(r))
                raise ValueError(f"--output {a.output}: could not write ({e.strerror or e}); "
                                 "the results went to stdout") from None
        elif lines is None:
            for o in outs:
                print(o.text if o.error is None else f"{o.finish_reason}: {o.error}")
        else:
            for r in rows:
                print(json.dumps(r))
        if interrupted is not None:
            raise interrupted
        if llm.broken:  # results are written; the run itself failed
            print(f"pp-runtime: error: {llm.broken}", file=sys.stderr)
            return 1
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from pp_runtime.bench import format_table, run_bench
    from pp_runtime.workload import load_run_config
    if not Path(a.config).is_file():
        raise ValueError(f"--config {a.config}: no such file")
    cfg = load_run_config(a.config)
    given = {k: v for k, v in engine_kwargs(a).items() if v is not None and k not in ("scheduler", "verbose")}
    if given.get("launcher") == "torchrun":
        raise ValueError("bench runs with --launcher local or ray")
    cfg = cfg.with_overrides(**given)
    if a.schedulers or a.scheduler:
        from dataclasses import replace
        names = tuple(a.schedulers.split(",")) if a.schedulers else (a.scheduler,)
        bad = [n for n in names if n not in SCHEDULER_POLICIES]
        if bad:
            raise ValueError(f"--schedulers: unknown {', '.join(bad)} (choose from {', '.join(SCHEDULER_POLICIES)})")
        cfg = replace(cfg, schedulers=names)
    if a.out and a.run_dir and Path(a.out) != Path(a.run_dir):
        raise ValueError(f"--out {a.out} and --run-dir {a.run_dir}: bench takes one output directory")
    out = a.out or a.run_dir or str(Path("runs") / Path(a.config).stem)
    _check_writable("--out", out, is_dir=True)
    from pp_runtime.run_outputs import RunInterrupted
    try:
        comparison = run_bench(cfg, out, progress=not a.quiet, verbose=not a.quiet)
    except RunInterrupted as e:  # schedulers done so far have their run directories; this one its results
        from pp_runtime.jsonl import write_results
        run_dir = Path(out) / e.scheduler
        _write_workers(run_dir, e.workers)
        write_results(str(run_dir / "results.jsonl"), [o.to_json() for o in e.outputs])
        raise
    print(format_table(comparison))
    print(f"run directories and comparison.json in {out}")
    return 0


def cmd_report(a: argparse.Namespace) -> int:
    from pp_runtime.report import make_report
    for d in a.dirs:
        if not Path(d).is_dir():
            raise ValueError(f"{d}: not a directory")
    _check_writable("--out", a.out, is_dir=True)
    for path in make_report(a.dirs, a.out):
        print(path)
    return 0


def cmd_simulate(a: argparse.Namespace) -> int:
    from pp_runtime.sim import run_simulation
    if not Path(a.config).is_file():
        raise ValueError(f"--config {a.config}: no such file")
    out = a.out or str(Path("runs") / f"sim_{Path(a.config).stem}")
    _check_writable("--out", out, is_dir=True)
    run_simulation(a.config, out, progress=not a.quiet)
    print(f"simulated run directories and comparison.json in {out}")
    return 0


def cmd_profile(a: argparse.Namespace) -> int:
    from pp_runtime.profile_grid import parse_grid
    _check_writable("--out", a.out, is_dir=True)
    grid = parse_grid(a.grid)  # a bad grid fails here, before any worker or sibling starts
    if a.pp > 1 or a.tp > 1 or a.launcher:
        return _profile_deployment(a, grid)
    from stages.profile import run_profile
    barrier = a.barrier
    if a.colocate > 1:
        barrier = (str(Path(a.out) / ".barrier"), str(a.colocate))
        shutil.rmtree(barrier[0], ignore_errors=True)
    siblings = [_profile_sibling(a, k, barrier) for k in range(1, a.colocate)]
    try:
        run_profile(a.model, a.device, a.dtype, a.out, grid=a.grid, threads=a.threads, attention=a.attention,
                    kv_dtype=a.kv_cache_dtype, matmul_precision=a.matmul_precision,
                    progress=not a.quiet, ready=(lambda: _file_barrier(barrier[0], int(barrier[1])))
                    if barrier else None)
    finally:
        failed = [k for k, p in enumerate(siblings, 1) if p.wait() != 0]
    if failed:
        raise RuntimeError(f"co-located profile(s) {failed} failed; see {a.out}/colocated-K/profile.log")
    return 0


def _profile_deployment(a: argparse.Namespace, grid: object) -> int:
    from pp_runtime.llm import LLM
    from pp_runtime.profile_deploy import profile_deployment
    if a.colocate > 1:
        raise ValueError("--colocate profiles one worker in N processes; a deployment (--pp/--tp/--launcher) "
                         "already runs all its workers at once")
    partition = parse_partition(a.partition)
    with LLM(a.model, pp=a.pp, tp=a.tp, launcher=a.launcher, dtype=a.dtype, device=a.device, attention=a.attention,
             block_size=grid.block_size, memory_budget_gb=a.memory_budget_gb, max_model_len=grid.max_len(),
             partition=partition, threads=a.threads, kv_cache_dtype=a.kv_cache_dtype,
             matmul_precision=a.matmul_precision) as llm:
        profile_deployment(llm, a.grid, a.out, progress=not a.quiet)
    print(f"per-stage profiles in {a.out}/stage-K/profile.csv")
    return 0


def _profile_sibling(a: argparse.Namespace, k: int, barrier: tuple[str, str]) -> subprocess.Popen:
    """The same profile in another process (its own model copy and cache), output in OUT/colocated-K."""
    out = Path(a.out) / f"colocated-{k}"
    out.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "launch.cli", "profile", "--device", a.device, "--dtype", a.dtype,
            "--attention", a.attention, "--threads", str(a.threads), "--grid", a.grid, "--out", str(out), "--quiet",
            "--kv-cache-dtype", a.kv_cache_dtype, "--matmul-precision", a.matmul_precision,
            "--barrier", *barrier]
    if a.model:
        args += ["--model", a.model]
    with open(out / "profile.log", "w") as log:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)


def _file_barrier(folder: str, parties: int, timeout_s: float = 600.0) -> None:
    """Co-located profiles start timing together: each drops a file, then waits for all N."""
    os.makedirs(folder, exist_ok=True)
    Path(folder, f"ready-{os.getpid()}").touch()
    deadline = time.monotonic() + timeout_s
    while len(os.listdir(folder)) < parties:
        if time.monotonic() > deadline:
            raise RuntimeError(f"co-located profiles: only {len(os.listdir(folder))} of {parties} became ready")
        time.sleep(0.05)


def sampling_defaults(a: argparse.Namespace) -> object:
    """SamplingParams from --max-tokens/--temperature/--top-p/--top-k; errors name the flag."""
    from pp_runtime import SamplingParams
    if not math.isfinite(a.temperature):  # inf would sample uniformly, whatever the model says
        raise ValueError(f"--temperature must be a finite number ≥ 0, got {a.temperature}")
    try:
        return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k)
    except ValueError as e:
        field, _, rest = str(e).partition(" ")  # messages start with the field name
        raise ValueError(f"--{field.replace('_', '-')} {rest}") from None


def _check_writable(flag: str, path: str | None, is_dir: bool) -> None:
    """Fail before a long run rather than lose its results at the end."""
    if not path:
        return
    p = Path(path)
    if p.exists() and p.is_dir() != is_dir:
        raise ValueError(f"{flag} {path}: is {'not ' if is_dir else ''}a directory")
    if not is_dir and not p.parent.is_dir():
        raise ValueError(f"{flag} {path}: directory {p.parent} does not exist")
    # what will be written into: the file or directory itself if it exists, else the nearest
    # existing ancestor (a run directory is created with its parents)
    target = p if p.exists() else next(q for q in p.absolute().parents if q.exists())
    if not os.access(target, os.W_OK) or (target.is_dir() and not os.access(target, os.X_OK)):
        raise ValueError(f"{flag} {path}: {target} is not writable")


def _write_workers(run_dir: Path, infos: list[dict]) -> None:
    from pp_runtime.rundir import WORKER_FIELDS
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "workers.json").write_text(json.dumps([{k: w[k] for k in WORKER_FIELDS if k in w} for w in infos],
                                                     indent=1))


def _tokenizer(model: str | None) -> object:
    from pp_runtime.tokenizer import load_tokenizer
    from stages.weights import resolve_model
    source = resolve_model(model)
    tok = load_tokenizer(source.kind, source.path)
    if tok is None:
        raise ValueError(f"model {source.path} has no tokenizer: --prompt needs one; pass token ids with --input")
    return tok


def _chat(tok: object, text: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def main(argv: list[str] | None = None, keep_handlers: bool = False) -> int:
    """Run one command. In process (tests, torchrun_main) the caller's signal handlers come back
    afterwards; the console script (`entry`) keeps ours until the interpreter is gone."""
    args = build_parser().parse_args(argv)
    interrupts = _Interrupts()
    interrupts.install()
    try:
        return {"generate": cmd_generate, "bench": cmd_bench, "report": cmd_report,
                "profile": cmd_profile, "simulate": cmd_simulate}[args.command](args)
    except (ValueError, OSError) as e:  # user-caused (bad value, unreadable/unwritable path): one line
        print(f"pp-runtime: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        detail = f": {e}" if str(e) and str(e) != interrupts.name else ""
        print(f"pp-runtime: interrupted by {interrupts.name}{detail}", file=sys.stderr)
        return interrupts.exit_code
    except SystemExit as e:
        if e.code != signal.SIGTERM:
            raise
        # ray.init's own SIGTERM handler (sys.exit(15)) is in charge while Ray starts up.
        print("pp-runtime: interrupted by SIGTERM while starting", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if not keep_handlers:
            interrupts.restore()


def entry() -> int:
    """The `pp-runtime` console script. After the command, Ray's exit hooks still stop its
    processes and the interpreter still shuts down; a repeated SIGTERM landing then (a second
    `kill`, a supervisor's) met the default disposition again and ended the process by the
    signal (exit -15) instead of 143. So the handler that ignores repeats stays through the exit
    hooks, and the last hook ignores both signals: CPython puts the default disposition back for
    every Python-level handler when it finalizes, but leaves SIG_IGN alone."""
    atexit.register(_ignore_interrupts)  # registered first, so it runs after Ray's hooks
    return main(keep_handlers=True)


def _ignore_interrupts() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


if __name__ == "__main__":
    sys.exit(entry())
