"""Concept coverage: which concepts of a ranked list the captions mention, and weights that raise the rare ones.

Input: a concept list (CSV or Parquet: concept, rank; e.g. Wikipedia articles by PageRank) and the
captioned pool. Full-text search runs in DuckDB. Its `fts` extension must be downloaded, which this
offline setting cannot do (`fts_status` records the attempt), so the index is built in SQL: a
positional inverted index (term, id, position) over the searched columns, lower-cased and lightly
stemmed (a trailing plural "s"), and a concept of n terms matches a row where its terms sit at
consecutive positions: phrase search, so "stop sign" is not found in "a sign ... stop".

Sampling weight of a row: (median count over covered concepts / count of its rarest concept) ** alpha,
capped at `max_weight`, 1 for rows that mention no concept, then normalised to mean 1. A concept's
weighted share is its rows' part of the weight mass; the report shows it rising for rare concepts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from kiln.config import ConceptConfig
from kiln.paths import repo_file
from kiln.schemas import CONCEPT_COUNTS, CONCEPT_WEIGHTS, check_schema
from kiln.sql import reproducible_connection
from kiln.stage import read_dataset, write_table

# lower-case terms, then a light stemmer: a trailing plural "s" goes (not "ss", not short words)
_TERMS = (
    "list_transform(list_filter(regexp_split_to_array(lower({x}), '[^a-z0-9]+'), lambda t: t <> ''), "
    "lambda t: CASE WHEN length(t) > 3 AND t LIKE '%s' AND t NOT LIKE '%ss' THEN t[:-2] ELSE t END)"
)


def _arrow(con: duckdb.DuckDBPyConnection, sql: str) -> pa.Table:
    rel = con.sql(sql)
    return rel.to_arrow_table() if hasattr(rel, "to_arrow_table") else rel.arrow()  # DuckDB 2 renamed it


def load_concepts(path: Path | str) -> pa.Table:
    """concept (str), rank (int64) from CSV or Parquet; blank and repeated concepts dropped (best rank kept)."""
    path = repo_file(path)
    if not path.is_file():
        raise FileNotFoundError(f"concept list {path} does not exist (cfg.data.concepts.path)")
    reader = "read_parquet" if path.suffix == ".parquet" else "read_csv"
    sql = f"""SELECT trim(CAST(concept AS VARCHAR)) AS concept, min(CAST(rank AS BIGINT)) AS rank FROM {reader}('{str(path).replace("'", "''")}')
              WHERE trim(CAST(concept AS VARCHAR)) <> '' GROUP BY 1 ORDER BY rank, concept"""
    return _arrow(reproducible_connection(), sql)


def fts_status(con: duckdb.DuckDBPyConnection) -> str:
    """Whether DuckDB's full-text extension loads here; offline it cannot be downloaded."""
    try:
        con.execute("LOAD fts")
        return "loaded"
    except duckdb.Error as e:
        return f"unavailable: {str(e).splitlines()[0][:160]}"


def concept_hits(
    pool: pa.Table, concepts: pa.Table, columns: list[str], con: duckdb.DuckDBPyConnection | None = None
) -> pa.Table:
    """(concept, id) for every phrase match, through the SQL positional inverted index."""
    con = con or reproducible_connection()
    con.register("pool", pool.select(["id", *columns]))
    con.register("concept_list", concepts)
    text = "concat_ws(' ', " + ", ".join(f"coalesce({c}, '')" for c in columns) + ")"
    con.execute(f"""CREATE OR REPLACE TEMP TABLE postings AS
        SELECT id, terms[pos] AS term, pos FROM (SELECT id, {_TERMS.format(x=text)} AS terms FROM pool),
        LATERAL (SELECT unnest(range(1, len(terms) + 1)) AS pos)""")
    con.execute(f"""CREATE OR REPLACE TEMP TABLE concept_terms AS
        SELECT concept, terms[k] AS term, k, len(terms) AS n FROM (SELECT concept, {_TERMS.format(x="concept")} AS terms FROM concept_list),
        LATERAL (SELECT unnest(range(1, len(terms) + 1)) AS k)""")
    return _arrow(
        con,
        """
        SELECT DISTINCT concept, id FROM (
            SELECT c.concept, p.id, p.pos - c.k AS start FROM concept_terms c JOIN postings p USING (term)
            GROUP BY c.concept, p.id, start, c.n HAVING count(DISTINCT c.k) = c.n)
        ORDER BY concept, id""",
    )


@dataclass(frozen=True)
class Coverage:
    counts: pa.Table  # CONCEPT_COUNTS, by rank
    weights: pa.Table  # CONCEPT_WEIGHTS, one row per pool row, by id
    report: dict


def coverage(pool: pa.Table, concepts: pa.Table, cfg: ConceptConfig) -> Coverage:
    """Counts, weights and the coverage summary of one pool against one concept list."""
    con = reproducible_connection()
    fts = fts_status(con)
    hits = concept_hits(pool, concepts, cfg.columns, con)
    con.register("hits", hits)
    con.register("ids", pool.select(["id"]))
    n = pool.num_rows
    counts = con.execute("SELECT concept, count(*) AS rows FROM hits GROUP BY concept").fetchall()
    median = float(
        con.execute("SELECT coalesce(median(c), 1) FROM (SELECT count(*) AS c FROM hits GROUP BY concept)").fetchall()[
            0
        ][0]
    )
    weights = _arrow(
        con,
        f"""
        WITH per_concept AS (SELECT concept, count(*) AS c FROM hits GROUP BY concept),
        per_row AS (
            SELECT h.id, list(h.concept ORDER BY l.rank, h.concept) AS concepts, min(p.c) AS rarest
            FROM hits h JOIN per_concept p USING (concept) JOIN concept_list l USING (concept) GROUP BY h.id),
        raw AS (
            SELECT i.id, coalesce(r.concepts, []) AS concepts,
                   CASE WHEN r.rarest IS NULL THEN 1.0 ELSE least({cfg.max_weight}, pow({median} / r.rarest, {cfg.alpha})) END AS w
            FROM ids i LEFT JOIN per_row r USING (id))
        SELECT id, to_json(concepts)::VARCHAR AS concepts, w / (SELECT avg(w) FROM raw) AS sampling_weight FROM raw ORDER BY id""",
    )
    con.register("weights", weights)
    counts_t = _arrow(
        con,
        f"""
        SELECT l.concept, l.rank, count(h.id) AS rows, count(h.id) / {max(n, 1)}::DOUBLE AS share,
               coalesce(sum(w.sampling_weight), 0) / {max(n, 1)}::DOUBLE AS weighted_share
        FROM concept_list l LEFT JOIN hits h USING (concept) LEFT JOIN weights w USING (id)
        GROUP BY l.concept, l.rank ORDER BY l.rank, l.concept""",
    )
    counts_t = check_schema(counts_t, CONCEPT_COUNTS, "concept counts")
    weights = check_schema(weights, CONCEPT_WEIGHTS, "concept weights")
    covered = [r for r in counts_t.to_pylist() if r["rows"]]
    by_count = sorted(covered, key=lambda r: (r["rows"], r["rank"]))
    rare = by_count[: max(1, len(by_count) // 4)] if by_count else []
    common = by_count[-max(1, len(by_count) // 4) :] if by_count else []
    report = {
        "pool_rows": n,
        "concepts": counts_t.num_rows,
        "covered": len(covered),
        "uncovered": [r["concept"] for r in counts_t.to_pylist() if not r["rows"]],
        "rows_with_a_concept": int(sum(1 for c in weights.column("concepts").to_pylist() if c != "[]")),
        "median_count": median,
        "alpha": cfg.alpha,
        "max_weight": cfg.max_weight,
        "index": "sql-positional-inverted-index",
        "fts_extension": fts,
        "rare_concepts": [r["concept"] for r in rare],
        "rare_share": sum(r["share"] for r in rare),
        "rare_weighted_share": sum(r["weighted_share"] for r in rare),
        "common_share": sum(r["share"] for r in common),
        "common_weighted_share": sum(r["weighted_share"] for r in common),
        "hits": dict(sorted((c, int(k)) for c, k in counts)),
    }
    report["rare_boost"] = report["rare_weighted_share"] / report["rare_share"] if report["rare_share"] else None
    return Coverage(counts_t, weights, report)


def coverage_plot(counts: pa.Table, path: Path | None = None):
    """Share of each covered concept before and after weighting, rarest first (log scale)."""
    from kiln.viz import line_plot

    rows = sorted((r for r in counts.to_pylist() if r["rows"]), key=lambda r: (r["rows"], r["rank"]))
    series = {
        "share of rows": [r["share"] for r in rows],
        "share of sampling weight": [r["weighted_share"] for r in rows],
    }
    return line_plot(
        series, title="concept coverage, rarest concept first", xlabel="concept (by row count)", path=path, logy=True
    )


def write_coverage(pool_folder: Path | str, out: Path | str, cfg: ConceptConfig) -> dict:
    """The coverage asset: OUT/counts.parquet, OUT/weights.parquet, OUT/report.json, OUT/coverage.png."""
    pool_folder, out = Path(pool_folder), Path(out)
    pool = read_dataset(pool_folder / "kept" if (pool_folder / "kept").is_dir() else pool_folder)
    cov = coverage(pool, load_concepts(cfg.path), cfg)
    out.mkdir(parents=True, exist_ok=True)
    write_table(cov.counts, out / "counts.parquet")
    write_table(cov.weights, out / "weights.parquet")
    (out / "report.json").write_text(json.dumps(cov.report, indent=2, sort_keys=True) + "\n")
    coverage_plot(cov.counts, out / "coverage.png")
    return cov.report


def coverage_of(rewritten: Path, out: Path, cfg) -> dict:
    """`kiln coverage` (the `coverage` node): `write_coverage` under the config's `data.concepts`."""
    return write_coverage(rewritten, out, cfg.data.concepts)


def read_weights(out: Path | str) -> pa.Table:
    return pq.read_table(Path(out) / "weights.parquet")
