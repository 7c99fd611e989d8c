"""The bodies of `pp-runtime generate`, `bench`, `report` and `simulate`; `profile` is in
launch/profile_cmd.py. Each takes the parsed arguments and returns the exit status; a ValueError
or OSError is a usage error that launch/cli.py: main prints on one line.

    pp-runtime bench --config configs/runs/<name>.yaml --schedulers sarathi,orca
    cmd_bench(build_parser().parse_args(["bench", "--config", path]))  # the same, in process
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from launch.parser import engine_kwargs
from pp_runtime.config import SCHEDULER_POLICIES
from pp_runtime.configs_dir import find_config


def cmd_generate(a: argparse.Namespace) -> int:
    from pp_runtime.jsonl import read_requests
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
    check_writable("--output", None if a.output == "-" else a.output, is_dir=False)
    check_writable("--run-dir", a.run_dir, is_dir=True)
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
            for o in outs:  # each sample's text, but where cut at a stop string already
                o.fill_texts(tok.decode_output)
        else:  # a JSONL "prompt" text gets its output's text back, as LLM.generate gives it
            outs = [llm.with_text(o, x.prompt) for o, x in zip(outs, lines)]
        rows = [o.to_json() for o in outs]
        # Results first (--output or stdout), the run directory after: a run directory that
        # cannot be written (disk full, a worker gone before its timings were read) must not
        # take the results with it.
        failed = []
        for write in (lambda: _emit_results(a, outs, rows, texts=lines is None),
                      lambda: a.run_dir and _write_run_dir(a.run_dir, llm, rows, plots=interrupted is None)):
            try:
                write()
            except ValueError as e:  # the other destination is still written
                failed.append(str(e))
        if failed:
            raise ValueError("; ".join(failed))
        if interrupted is not None:
            raise interrupted
        if llm.broken:  # results are written; the run itself failed
            print(f"pp-runtime: error: {llm.broken}", file=sys.stderr)
            return 1
    return 0


def _emit_results(a: argparse.Namespace, outs: list, rows: list[dict], texts: bool) -> None:
    """Write the results to --output, else print them: texts one per line, JSONL rows otherwise."""
    from pp_runtime.jsonl import write_results
    if a.output and a.output != "-":  # "-", as --input -: stdout, JSONL rows even for --prompt
        try:
            write_results(a.output, rows)
        except OSError as e:  # checked at start, but the disk may fill or the path go away
            for r in rows:  # the run's results, on stdout rather than lost
                print(json.dumps(r))
            raise ValueError(f"--output {a.output}: could not write ({e.strerror or e}); "
                             "the results went to stdout") from None
    elif texts and not a.output:
        for c in (c for o in outs for c in o.outputs):  # with --n, each sample in turn
            print(c.text if c.error is None else f"{c.finish_reason}: {c.error}")
    else:
        for r in rows:
            print(json.dumps(r))


def _write_run_dir(run_dir: str, llm: object, rows: list[dict], plots: bool) -> None:
    """Timings, summary and (unless ``plots`` is False: an interrupted run leaves at once) plots
    into --run-dir; ``rows``, what --output got (texts included), go beside them as results.jsonl."""
    from pp_runtime.executor import WorkerError
    from pp_runtime.jsonl import write_results
    from pp_runtime.rundir import write_run_dir
    try:
        if not llm.broken:  # timings live on the workers; a dead one has none to give
            write_run_dir(run_dir, llm)
        Path(run_dir).mkdir(parents=True, exist_ok=True)  # (what write_run_dir wrote lacks the texts)
        write_results(str(Path(run_dir) / "results.jsonl"), rows)
    except (OSError, WorkerError) as e:
        detail = e.strerror if isinstance(e, OSError) and e.strerror else e
        raise ValueError(f"--run-dir {run_dir}: could not write ({detail}); the results were written "
                         "already") from None
    if plots and not llm.broken:
        write_plots("--run-dir", run_dir)


def write_plots(flag: str, out: str) -> None:
    """The report's PNGs into a run or bench directory (DESIGN.md §3.4), as `pp-runtime report
    OUT` would write them: the data files are written already, so a plot that fails says so in
    one line and costs nothing else."""
    from pp_runtime.report import make_report
    try:
        make_report([out])
    except Exception as e:  # noqa: BLE001 - a plot's failure, whatever it is, must not hide the run's files
        if isinstance(e, OSError) and e.strerror:
            detail = e.strerror
        else:
            detail = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        raise ValueError(f"{flag} {out}: plots not written ({detail}); the run's files were written "
                         "already") from None


def cmd_bench(a: argparse.Namespace) -> int:
    from pp_runtime.bench import format_table, run_bench
    from pp_runtime.run_config import load_run_config
    config = find_config(a.config, "runs")
    if not config.is_file():
        raise ValueError(f"--config {a.config}: no such file, nor a config of that name in configs/runs/")
    cfg = load_run_config(config)
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
    out = a.out or a.run_dir or str(Path("runs") / config.stem)
    check_writable("--out", out, is_dir=True)
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
    write_plots("--out", out)
    print(f"run directories, comparison.json and plots in {out}")
    return 0


def cmd_report(a: argparse.Namespace) -> int:
    from pp_runtime.report import make_report
    for d in a.dirs:
        if not Path(d).is_dir():
            raise ValueError(f"{d}: not a directory")
    check_writable("--out", a.out, is_dir=True)
    for path in make_report(a.dirs, a.out, window_mbs=a.window_mbs, window_s=a.window_s):
        print(path)
    return 0


def cmd_simulate(a: argparse.Namespace) -> int:
    from pp_runtime.sim import run_simulation
    config = find_config(a.config, "sim")
    if not config.is_file():
        raise ValueError(f"--config {a.config}: no such file, nor a config of that name in configs/sim/")
    out = a.out or str(Path("runs") / f"sim_{config.stem}")
    check_writable("--out", out, is_dir=True)
    run_simulation(str(config), out, progress=not a.quiet)
    write_plots("--out", out)
    print(f"simulated run directories, comparison.json and plots in {out}")
    return 0


def sampling_defaults(a: argparse.Namespace) -> object:
    """SamplingParams from --n/--max-tokens/--temperature/--top-p/--top-k/--logprobs/--min-tokens and
    the penalties; errors name the flag."""
    from pp_runtime import SamplingParams
    if not math.isfinite(a.temperature):  # inf would sample uniformly, whatever the model says
        raise ValueError(f"--temperature must be a finite number ≥ 0, got {a.temperature}")
    try:
        return SamplingParams(n=a.n, max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                              top_k=a.top_k, logprobs=a.logprobs, min_tokens=a.min_tokens,
                              presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
                              repetition_penalty=a.repetition_penalty)
    except ValueError as e:
        field, _, rest = str(e).partition(" ")  # messages start with the field name
        raise ValueError(f"--{field.replace('_', '-')} {rest}") from None


def check_writable(flag: str, path: str | None, is_dir: bool) -> None:
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
    # written while the run starts, for whoever watches the run directory (a monitor finding the
    # workers' pids): through a rename, so a reader never sees it half written
    tmp = run_dir / "workers.json.tmp"
    tmp.write_text(json.dumps([{k: w[k] for k in WORKER_FIELDS if k in w} for w in infos], indent=1))
    tmp.replace(run_dir / "workers.json")


def _tokenizer(model: str | None) -> object:
    from pp_runtime.tokenizer import load_tokenizer
    from stages.model_source import resolve_model
    source = resolve_model(model)
    tok = load_tokenizer(source.kind, source.path)
    if tok is None:
        raise ValueError(f"model {source.path} has no tokenizer: --prompt needs one; pass token ids with --input")
    return tok


def _chat(tok: object, text: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
