"""`python -m kvtier ...`: the `kvtier` command."""

from kvtier.cli import main

main()
