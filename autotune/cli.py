"""The `autotune` command line: subcommands are small registered pieces, one module each under
``autotune/commands/``. Errors a user can cause print as one line (``--debug`` for the traceback)."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass

from autotune.exceptions import AutotuneError, Terminated
from trainer.config import ConfigError

DESCRIPTION = ("Find the fastest PyTorch DDP configuration for a training job on this machine's GPUs (or, without "
               "GPUs, on the CPU): `autotune search` runs an Optuna study of short torchrun trials; `autotune show`, "
               "`export`, `train`, `report` and `dashboard` use what it found.")


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int | None]


_COMMANDS: dict[str, Command] = {}


def command(name: str, help: str, arguments: Callable[[argparse.ArgumentParser], None] = lambda p: None):
    """Register the decorated ``run(args) -> exit code`` as subcommand ``name``; ``arguments`` declares its flags."""

    def wrap(run):
        _COMMANDS[name] = Command(name, help, arguments, run)
        return run

    return wrap


def _load_commands() -> None:
    import autotune.commands as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"autotune.commands.{info.name}")


def build_parser() -> argparse.ArgumentParser:
    _load_commands()
    parser = argparse.ArgumentParser(prog="autotune", description=DESCRIPTION)
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in sorted(_COMMANDS.values(), key=lambda c: c.name):
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt as e:
        print(f"autotune: {str(e) or 'interrupted'}", file=sys.stderr)
        return 128 + (e.signum if isinstance(e, Terminated) else signal.SIGINT)
    except Exception as e:
        if args.debug:
            raise
        if isinstance(e, (AutotuneError, ConfigError)):
            print(f"autotune {args.command}: error: {e}", file=sys.stderr)
            return getattr(e, "exit_code", 2)
        print(f"autotune {args.command}: unexpected {type(e).__name__}: {e} (rerun with --debug for the traceback)",
              file=sys.stderr)
        return 1
