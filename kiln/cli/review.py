"""`kiln review`: the door through which a person approves or rejects the clusters the cluster stage flagged
(the review table: assets.cluster_review)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kiln.errors import MissingInput, UnknownName


def add_parser(subparsers) -> argparse.ArgumentParser:
    r = subparsers.add_parser("review", help="list clusters flagged for review, or approve / reject one")
    r.add_argument("action", choices=["list", "approve", "reject", "pending"])
    r.add_argument("cluster", nargs="?", help="LEVEL:CLUSTER, or CLUSTER at the review level")
    r.add_argument("--note", default="")
    r.add_argument("--db", default=None, help="review DuckDB file (default: data.clustering.review_db)")
    r.add_argument("overrides", nargs="*")
    r.set_defaults(fn=review_cli)
    return r


def review_cli(args: argparse.Namespace) -> int:
    from assets.cluster_review import review_rows, set_decision
    from kiln.config import load_config

    c = load_config(list(getattr(args, "overrides", []) or [])).data.clustering
    db = args.db or c.review_db
    if not Path(db).exists():  # reading would create an empty table: say what is missing instead
        if args.action == "list":
            print(f"no clustering run yet: no review table at {db} (the cluster stage writes it)")
            return 0
        raise MissingInput(f"no clustering run yet: no review table at {db} (the cluster stage writes it)")
    if args.action == "list":
        rows = review_rows(db)
        for row in rows:
            print(
                f"{row['level']}:{row['cluster']:<4} {row['decision']:<8} size {row['size']:<5} {row['name']!r}  [{row['flag_reason']}] {row['note']}"
            )
        if not rows:
            print(f"no clusters flagged in {db}")
        return 0
    if not args.cluster:
        print("kiln review: which cluster? (LEVEL:CLUSTER)", file=sys.stderr)
        return 2
    level, cluster = args.cluster.split(":", 1) if ":" in args.cluster else (c.review_level, args.cluster)
    if not (str(level).isdigit() and str(cluster).isdigit()):
        raise UnknownName(f"{args.cluster!r} is not a cluster: LEVEL:CLUSTER or CLUSTER, whole numbers")
    set_decision(db, int(level), int(cluster), args.action, args.note)
    print(f"{level}:{cluster} -> {args.action}; the next cluster stage run honours it")
    return 0
