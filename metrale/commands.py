"""The subcommands of ``met``, each a thin layer over the public API."""

from __future__ import annotations

import argparse

from metrale.cli import command


def _version(p: argparse.ArgumentParser) -> None:
    pass


@command("version", "print the version")(_version)
def version(args: argparse.Namespace) -> int:
    import metrale

    print(metrale.__version__)
    return 0
