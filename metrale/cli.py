"""``met``: the command line. Each subcommand is a small function over the public API.

Errors are printed as one clear line (``met: <message>``) and exit with the error type's
documented status (docs/errors.md); so are interrupts (130) and file-system refusals such as a
full disk (12). ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable, Sequence

from metrale.lkb.errors import EXIT_INTERRUPTED, EXIT_OS_ERROR, AllocationError, MetraleError

Command = Callable[[argparse.Namespace], int]
_COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Command, str]] = {}


def command(name: str, help: str) -> Callable:
    """Register ``met <name>``: the decorated function adds its arguments; returns the runner."""

    def register(configure: Callable[[argparse.ArgumentParser], None]) -> Callable:
        def with_runner(run: Command) -> Command:
            _COMMANDS[name] = (configure, run, help)
            return run

        return with_runner

    return register


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` states every option's default: ``(default: 1024)`` after its help, unless the
    help already says it, the option is a switch (off unless given) or has no default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if ("default" in text or default is None or default is False
                or default is argparse.SUPPRESS or action.nargs == 0
                or not action.option_strings):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, list) else default
        return f"{text} (default: {shown})".replace("%", "%%").replace(
            "%%(default)s", "%(default)s")


def extend_command(name: str, configure: Callable[[argparse.ArgumentParser], None],
                   wrap: Callable[[argparse.Namespace, Command], int]) -> None:
    """Give ``met <name>`` more arguments (``configure``) and a runner ``wrap(args, run)``
    that may handle them and otherwise calls the command's own ``run``."""
    first, run, help_text = _COMMANDS[name]

    def both(p: argparse.ArgumentParser) -> None:
        first(p)
        configure(p)

    _COMMANDS[name] = (both, lambda args: wrap(args, run), help_text)


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``met`` with every registered subcommand."""
    import metrale
    from metrale import commands, evidence_cli, generate_cli  # noqa: F401 - registers them

    p = argparse.ArgumentParser(
        prog="met", description="Metrale: kernel plans for LLM inference, as category theory. "
                                "Start with `met models` and `met hardware`.",
        formatter_class=HelpFormatter)
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("--version", action="version", version=f"met {metrale.__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    from metrale import tune_cli  # noqa: F401 - registers met tune and met plan --costs
    for name, (configure, _run, help_text) in _COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text,
                            formatter_class=HelpFormatter)
        sp.add_argument("--debug", action="store_true", help="show tracebacks",
                        default=argparse.SUPPRESS)
        configure(sp)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``met`` console script."""
    p = parser()
    args = p.parse_args(argv)
    if not args.command:
        p.print_help()
        return 0
    _configure, run, _help = _COMMANDS[args.command]
    try:
        with warnings.catch_warnings():
            if not args.debug:  # one line, ``met: warning: …``, not Python's two
                warnings.showwarning = _show_warning
            return run(args)
    except MetraleError as e:
        if args.debug:
            raise
        print(f"met: {e}", file=sys.stderr)
        return e.exit_status
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("met: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return 0
    except OSError as e:  # the file system said no: one line naming the path, not a traceback
        if args.debug:
            raise
        where = f"{e.filename}: " if e.filename else ""
        print(f"met: {where}{e.strerror or e}", file=sys.stderr)
        return EXIT_OS_ERROR
    except MemoryError:
        if args.debug:
            raise
        print("met: out of host memory", file=sys.stderr)
        return AllocationError.exit_status


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"met: warning: {message}", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
