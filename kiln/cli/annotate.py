"""`kiln annotate`: label preference pairs in a local page (training.post.annotate), or export the labels as
human pairs."""

from __future__ import annotations

import argparse
from pathlib import Path

from kiln.progress import log


# --------------------------------------------------------------------------------------------- CLI
def add_parser(subparsers) -> argparse.ArgumentParser:
    a = subparsers.add_parser(
        "annotate",
        help="label preference pairs in a local page (human calibration), or --export the labels as human pairs",
    )
    a.add_argument("--pairs", required=True, help="a pairs folder (pairs.parquet of the preference_pairs stage)")
    a.add_argument(
        "--export",
        default=None,
        metavar="OUT",
        help="write OUT/pairs.parquet (source=human) from the labels instead of serving the page",
    )
    a.add_argument(
        "--overwrite",
        action="store_true",
        help="with --export: replace an OUT holding files kiln did not write (never the pairs folder)",
    )
    a.add_argument("--port", type=int, default=8765)
    a.add_argument(
        "--host", default="127.0.0.1", help="where the page listens; anything but 127.0.0.1 exposes it to the network"
    )
    a.add_argument("--annotator", default=None, help="the name labels are stored under (default: the login name)")
    store = a.add_mutually_exclusive_group()
    store.add_argument("--dsn", default=None, help="store labels in this Postgres (default: KILN_PG_DSN when set)")
    store.add_argument(
        "--db",
        default=None,
        help="store labels in this DuckDB file (default: human_labels.duckdb under the warehouse root)",
    )
    a.set_defaults(fn=annotate_cli)
    return a


def annotate_cli(args: argparse.Namespace) -> int:
    import getpass
    import json

    from training.post.annotate import Annotation, make_server
    from training.post.labels import human_pairs, open_labels

    if not 0 <= args.port <= 65535:
        print(f"kiln annotate: --port {args.port} is not a port (0..65535)")
        return 2
    store = open_labels(args.dsn, args.db)
    if args.export:
        print(
            json.dumps(
                human_pairs(Path(args.pairs), store, Path(args.export), args.overwrite), indent=2, sort_keys=True
            )
        )
        return 0
    annotation = Annotation(Path(args.pairs), store, args.annotator or getpass.getuser())
    server = make_server(annotation, args.host, args.port)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("annotate: listening on %s: anyone who reaches it can label", args.host)
    print(
        f"kiln annotate: http://{args.host}:{server.server_port}/  ({len(annotation.done)} / {len(annotation.order)} labelled; labels -> {store.where}; Ctrl-C stops)"
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
