"""`python -m flows.cli ...`: the `stagerl` command."""
import sys

from flows.cli import main

sys.exit(main())
