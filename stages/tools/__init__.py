"""Tools for multi-turn rollouts, in verl's shapes: a tool is a class with verl's life cycle
(create / execute / calc_reward / release, `base.py`), named in verl's tool config YAML
(`registry.py`: the built-ins by verl's class paths, a user tool by its `module.Class` path), run in
long-lived worker processes with a per-call deadline (`pool.py`) behind one object a rollout loop
holds (`toolset.py`: a call that is malformed, names an unknown tool, times out or raises comes
back as the tool's response text and a counted error kind, never as an exception). `parser.py`
reads verl's hermes `<tool_call>` format; `builtin.py` holds the GSM8K answer check, a calculator
(`calculator.py`: arithmetic over `ast`, no names or calls) and a Python runner whose snippets run
in a sandboxed subprocess (`sandbox.py`: no network, read-only file system outside its own
temporary directory, CPU-time, memory, wall-time, output and process limits).
"""
