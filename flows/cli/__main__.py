"""`python -m flows.cli ...`: the `stagerl` command."""
from flows.cli import entry

entry()
