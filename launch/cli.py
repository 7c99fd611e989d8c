"""`pp-runtime` command line (DESIGN.md §3.1); ``python -m launch.cli`` is the same.

    pp-runtime generate --prompt "What is the capital of France?" --chat
    pp-runtime generate --model llama-tiny --input in.jsonl --output out.jsonl --pp 2

Ctrl-C (SIGINT) or SIGTERM stops a run: the results so far are written (the unfinished
requests with finish_reason "cancelled"), the workers are killed, and the exit status is
130 or 143.
"""
from __future__ import annotations

import atexit
import signal
import sys

from launch.commands import cmd_bench, cmd_generate, cmd_report, cmd_simulate
from launch.interrupts import Interrupts, ignore_interrupts
from launch.parser import build_parser
from launch.profile_cmd import cmd_profile
from pp_runtime.executor import WorkerError


def main(argv: list[str] | None = None, keep_handlers: bool = False) -> int:
    """Run one command. In process (tests, torchrun_main) the caller's signal handlers come back
    afterwards; the console script (`entry`) keeps ours until the interpreter is gone."""
    args = build_parser().parse_args(argv)
    interrupts = Interrupts()
    interrupts.install()
    try:
        return {"generate": cmd_generate, "bench": cmd_bench, "report": cmd_report,
                "profile": cmd_profile, "simulate": cmd_simulate}[args.command](args)
    except (ValueError, OSError) as e:  # user-caused (bad value, unreadable/unwritable path): one line
        print(f"pp-runtime: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except WorkerError as e:  # a worker died or hung: name it on one line, not a traceback
        print(f"pp-runtime: error: {_one_line(e)}", file=sys.stderr)
        return 1
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
    atexit.register(ignore_interrupts)  # registered first, so it runs after Ray's hooks
    return main(keep_handlers=True)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


if __name__ == "__main__":
    sys.exit(entry())
