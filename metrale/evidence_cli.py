"""``met evidence``: list, import, export, prune and rebuild the evidence of the kernels.

Records live in two places: the export shipped with the kernels (``kernels/<hw>/EVIDENCE.toml``,
read only) and the user's store (SQLite in the cache directory, where ``met bench --record``
writes; ``$METRALE_EVIDENCE`` names another file). ``list`` shows both with whether each record
counts; ``import`` adds record files (either TOML layout) to the store; ``export`` writes the
records that count as a class's shipped export; ``prune`` deletes from the store what no longer
counts; ``rebuild`` sets a damaged store aside and makes a new one from the shipped export.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from metrale.cli import command

SHIPPED, STORED = "shipped", "store"
COUNTS, SUPERSEDED, STALE, UNKNOWN = "counts", "superseded", "stale", "unknown class"


def _args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    kernels = argparse.ArgumentParser(add_help=False)
    kernels.add_argument("--kernels", default=None,
                         help="kernels folder (default: the shipped one)")
    ls = sub.add_parser("list", parents=[kernels], help="the records and whether each counts")
    ls.add_argument("--hardware", default=None, help="only this class (default: every class)")
    ls.add_argument("--format", choices=("table", "json"), default="table")
    im = sub.add_parser("import", help="add record files ([[record]] tables or an export) to "
                                       "the store")
    im.add_argument("files", nargs="+", type=Path, help="TOML files of records")
    ex = sub.add_parser("export", parents=[kernels],
                        help="the records that count on a class, as its shipped EVIDENCE.toml")
    ex.add_argument("--hardware", required=True, help="the class to export")
    ex.add_argument("--out", type=Path, default=None,
                    help="file to write (replaced atomically; default: standard output)")
    pr = sub.add_parser("prune", parents=[kernels],
                        help="delete the store's records that no longer count")
    pr.add_argument("--hardware", default=None, help="only this class (default: every class)")
    pr.add_argument("--dry-run", action="store_true", help="say what would go, delete nothing")
    sub.add_parser("rebuild", parents=[kernels],
                   help="set the store aside and make a new one from the shipped export "
                        "(and what can be read from the old one)")


@command("evidence", "the evidence store and the shipped evidence: list, import, export, "
                     "prune, rebuild")(_args)
def evidence(args: argparse.Namespace) -> int:
    return {"list": _list, "import": _import, "export": _export, "prune": _prune,
            "rebuild": _rebuild}[args.action](args)


def _kernels_dir(args: argparse.Namespace) -> Path:
    from metrale.realize.hardware import default_kernels_dir

    return Path(args.kernels) if getattr(args, "kernels", None) else default_kernels_dir()


def _shipped(kernels: Path, hw: str | None = None):
    from metrale.realize.evidence import load_all_evidence

    load = load_all_evidence(kernels, store=None).load()
    return tuple(r for r in load.records if hw is None or r.hw == hw), load.errors


def _judged(kernels: Path, hw: str | None) -> list[tuple[object, str, str]]:
    """``(record, where, status)`` of every shipped and stored record (of ``hw``)."""
    from metrale.lkb.errors import ConfigError
    from metrale.realize.evidence_report import counting, current_sources
    from metrale.realize.evidence_store import EvidenceStore, record_digest

    shipped, _errors = _shipped(kernels, hw)
    stored = EvidenceStore.default().records(hw)
    seen = {record_digest(r) for r in shipped}
    rows = [(r, SHIPPED) for r in shipped] + [(r, STORED) for r in stored
                                              if record_digest(r) not in seen]
    current: dict[str, dict | None] = {}
    for r, _ in rows:
        if r.hw not in current:
            try:
                current[r.hw] = current_sources(r.hw, kernels)
            except ConfigError:
                current[r.hw] = None
    counts = {cls: set(counting([r for r, _ in rows if r.hw == cls], cur))
              for cls, cur in current.items() if cur is not None}
    out = []
    for r, where in rows:
        cur = current[r.hw]
        status = (UNKNOWN if cur is None else COUNTS if r in counts[r.hw] else
                  SUPERSEDED if r.source_hash in cur.get((r.family, r.point), ()) else STALE)
        out.append((r, where, status))
    return out


def _list(args: argparse.Namespace) -> int:
    import attrs
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from metrale.realize.evidence_store import default_store_path

    rows = _judged(_kernels_dir(args), args.hardware)
    if args.format == "json":
        print(json.dumps([{**attrs.asdict(r), "from": where, "status": status}
                          for r, where, status in rows], indent=2))
        return 0
    t = Table(title=f"evidence: {len(rows)} records (store: {default_store_path()})")
    for col in ("class", "point", "shape", "metric", "value", "date", "from", "status"):
        t.add_column(col, overflow="fold", no_wrap=col not in ("point", "shape"))
    for r, where, status in sorted(rows, key=lambda x: (x[0].hw, x[0].point, x[0].date)):
        t.add_row(*map(escape, (r.hw, r.point, r.shape or "-", r.metric,
                                f"{r.value:.4g} {r.unit}", r.date, where, status)))
    Console(soft_wrap=False).print(t)
    return 0


def _import(args: argparse.Namespace) -> int:
    from metrale.lkb.errors import ManyErrors
    from metrale.realize.evidence import load_evidence, record_evidence
    from metrale.realize.evidence_store import default_store_path

    records = []
    for f in args.files:
        if not f.is_file():
            raise FileNotFoundError(2, "no such file", str(f))
        load = load_evidence(f)
        if load.errors:  # nothing from a damaged file: fix it, then import it whole
            raise ManyErrors(load.errors) if len(load.errors) > 1 else load.errors[0]
        records += load.records
    added = record_evidence(records)
    print(f"imported {added} new of {len(records)} records into {default_store_path()}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from metrale.realize.evidence import export_text, write_export
    from metrale.realize.evidence_report import counting, current_sources
    from metrale.realize.evidence_store import EvidenceStore

    kernels = _kernels_dir(args)
    current = current_sources(args.hardware, kernels)
    shipped, errors = _shipped(kernels, args.hardware)
    if errors:
        raise errors[0]
    records = counting((*shipped, *EvidenceStore.default().records(args.hardware)), current)
    if args.out is None:
        sys.stdout.write(export_text(args.hardware, records))
    else:
        write_export(args.out, args.hardware, records)
        print(f"wrote {len(records)} records that count on {args.hardware} to {args.out}",
              file=sys.stderr)
    return 0


def _prune(args: argparse.Namespace) -> int:
    from metrale.realize.evidence_store import EvidenceStore

    rows = _judged(_kernels_dir(args), args.hardware)
    gone = [r for r, where, status in rows if where == STORED and status in (STALE, SUPERSEDED)]
    unknown = sum(1 for _, where, status in rows if where == STORED and status == UNKNOWN)
    store = EvidenceStore.default()
    n = len(gone) if args.dry_run else store.remove(gone)
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{verb} {n} records that no longer count from {store.path}"
          + (f"; kept {unknown} of classes this kernels folder does not define" if unknown
             else ""))
    return 0


def _rebuild(args: argparse.Namespace) -> int:
    from metrale.realize.evidence_store import EvidenceStore

    shipped, _errors = _shipped(_kernels_dir(args))
    store = EvidenceStore.default()
    aside, salvaged, total = store.rebuild(shipped)
    if aside is not None:
        print(f"set the old store aside as {aside} ({salvaged} records could be read from it)")
    print(f"{store.path} holds {total} records: the shipped evidence"
          + (" and the old store's readable records" if salvaged else ""))
    return 0
