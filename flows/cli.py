"""The `stagerl` command line. Each subcommand lives in its own flows/cmd_*.py module with
`register(subparsers)`; that function adds a parser and sets `func(args) -> int` as its default.
Modules import heavy libraries (torch, transformers, prefect) inside their functions, so
`stagerl plan` answers without loading a model framework."""
import argparse
import importlib
import sys

COMMAND_MODULES = [
    "flows.cmd_plan",
    "flows.cmd_model",
    "flows.cmd_data",
    "flows.cmd_runs",
    "flows.cmd_inspect",
    "flows.cmd_query",
    "flows.cmd_plot",
    "flows.cmd_stats",
    "flows.cmd_train",
    "flows.cmd_verify",
    "flows.cmd_fork",
    "flows.cmd_rescore",
    "flows.cmd_delete",
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
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
