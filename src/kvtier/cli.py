"""The `kvtier` command: one typer app; each subcommand lives next to the code it drives.

Each module in `_COMMAND_MODULES` exposes `register(app: typer.Typer) -> None`.
Bad input anywhere ends in a one-line error and exit code 2, never a traceback.
"""

from __future__ import annotations

import functools
import importlib
import sys

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="kvtier: size, shrink and spill the KV cache of long-context LLM inference.")

_COMMAND_MODULES = [
    "kvtier.plan.cli",       # kvtier plan
    "kvtier.demo",           # kvtier demo (make run)
    "kvtier.generate_cli",   # kvtier generate
    "kvtier.server.cli",     # kvtier serve
    "kvtier.route.cli",      # kvtier route
    "kvtier.evals.cli",      # kvtier eval
    "kvtier.sim.cli",        # kvtier simulate
    "kvtier.bench.cli",      # kvtier bench ...
]


@functools.cache  # once per process: main() may be called repeatedly (tests)
def _register_all() -> None:
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a command not written yet in this checkout
            if name == exc.name or name.startswith(f"{exc.name}."):
                continue
            raise
        module.register(app)


def main(argv: list[str] | None = None) -> None:
    from kvtier.errors import UserError
    from kvtier.units import SizeError

    _register_all()
    try:
        app(args=argv, standalone_mode=True)
    except (UserError, SizeError, FileNotFoundError) as exc:
        print(f"kvtier: error: {exc}", file=sys.stderr)
        sys.exit(2)
