"""The `stagerl` command line. Each subcommand lives in its own module of this package with
`register(subparsers)`; that function adds a parser and sets `func(args) -> int` as its default.
The options several commands share are added by flows/cli/args.py. Modules import heavy
libraries (torch, transformers, prefect) inside their functions, so `stagerl plan` answers
without loading a model framework."""
import argparse
import importlib

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

