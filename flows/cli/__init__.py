"""The `stagerl` command line. Each subcommand lives in its own module of this package with
`register(subparsers)`; that function adds a parser and sets `func(args) -> int` as its default.
The options several commands share are added by flows/cli/args.py. Modules import heavy
libraries (torch, transformers, prefect) inside their functions, so `stagerl plan` answers
without loading a model framework."""
import argparse
import atexit
import importlib
import os
import sys
import threading
import traceback

from flows.cli.args import hydra_config

COMMAND_MODULES = [
    "flows.cli.plan",
    "flows.cli.model",
    "flows.cli.data",
    "flows.cli.runs",
    "flows.cli.inspect",
    "flows.cli.query",
    "flows.cli.plot",
    "flows.cli.stats",
    "flows.cli.train",
    "flows.cli.verify",
    "flows.cli.fork",
    "flows.cli.rescore",
    "flows.cli.delete",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stagerl",
        description="RL post-training of LLMs as a pipeline of inspectable, resumable stages.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # `stagerl fork SRC NEW --at 3:advantage key=value`: overrides after an option
        if not getattr(args, "trailing_overrides", False) or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = list(args.overrides or []) + extra
    problem = hydra_config(args)
    if problem:
        parser.error(problem)
    return int(args.func(args) or 0)



def entry() -> None:
    """The `stagerl` console command (and `python -m flows.cli`): main(), then finish_process.
    main() stays a plain function for callers in a process of their own (tests, notebooks)."""
    try:
        code = main()
    except SystemExit as exc:  # argparse's usage errors (2), --help (0)
        code = exc.code
    except KeyboardInterrupt:
        print("stagerl: interrupted", file=sys.stderr)
        code = 130
    except BaseException:  # noqa: BLE001  (printed as Python would, then exit 1)
        traceback.print_exc()
        code = 1
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    finish_process(int(code or 0))


def finish_process(code: int) -> None:
    """Exit with `code` after everything Python-level that an exit does (non-daemon threads
    joined, atexit handlers run, stdout and stderr flushed), skipping the C-level teardown that
    follows it: native thread pools (Arrow's, reading parquet) can still be winding down there,
    and a std::thread destroyed while joinable aborts a finished command with exit 134
    ("terminate called without an active exception"; apache/arrow issues 34314, 39862)."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`stagerl query ... | head`)
            pass
    os._exit(code)
