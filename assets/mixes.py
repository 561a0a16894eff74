"""Dataset mixes as DuckDB queries over the warehouse, each with its proportions recorded next to it.

- pretraining, bottom-up: the whole pool (minus `pretrain_exclude`); its proportions are what the pool
  holds, measured per `group_by` (default: the source folder or tar shard) and recorded.
- midtraining, top-down: configured parts (a DuckDB predicate each: a domain, source or cluster) with
  shares of a fixed size; quotas by largest remainder, rows drawn in a seeded hash order, and a row
  counts for the first part it matches only. A part that has too few rows is recorded as short.
- SFT: a small set, the best `sft_size` candidates by `sft_order`.
- domain SFT (`domains`): per domain, the best `size` rows matching its predicate: mix `domain_<name>`.

The warehouse view is the rewrite stage's rows plus `source`, `h` (md5 of seed:id: the draw order)
and `sampling_weight` (from the concept coverage weights when given, else 1). The SQL of each mix is
stored in OUT/mixes.json and in the Parquet metadata, so a mix can be re-run and audited.
"""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pyarrow as pa

from kiln.config import DomainMix, MixConfig
from kiln.schemas import MIX, check_schema
from kiln.sql import reproducible_connection
from kiln.stage import read_dataset, write_table

# where a row came from: a tar member's shard file (kiln.uri: tar://<shard>#<member>), else the file's folder
SOURCE = r"""CASE WHEN starts_with(uri, 'tar://') THEN regexp_extract(uri, '^tar://(?:[^#]*/)?([^/#]+)#', 1)
    ELSE regexp_extract(uri, '([^/]+)/[^/]+$', 1) END"""


def quotas(parts: list[tuple[str, float]], size: int) -> dict[str, int]:
    """Integer row counts per part that sum to `size`, by largest remainder; shares must sum to 1."""
    total = sum(share for _, share in parts)
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"midtrain shares sum to {total}, not 1: {parts}")
    raw = {name: size * share for name, share in parts}
    q = {name: int(v) for name, v in raw.items()}
    for name in sorted(raw, key=lambda n: (-(raw[n] - q[n]), n))[: size - sum(q.values())]:
        q[name] += 1
    return q


def warehouse(pool: pa.Table, weights: pa.Table | None, seed: int) -> duckdb.DuckDBPyConnection:
    con = reproducible_connection()
    con.register("pool_rows", pool)
    con.register(
        "concept_weights",
        weights
        if weights is not None
        else pa.table({"id": pa.array([], pa.string()), "sampling_weight": pa.array([], pa.float64())}),
    )
    con.execute(f"""CREATE VIEW warehouse AS
        SELECT p.*, {SOURCE} AS source, md5('{seed}:' || p.id) AS h, coalesce(w.sampling_weight, 1.0) AS sampling_weight
        FROM pool_rows p LEFT JOIN (SELECT id, sampling_weight FROM concept_weights) w USING (id)""")
    return con


def _run(con: duckdb.DuckDBPyConnection, sql: str) -> pa.Table:
    rel = con.sql(sql)
    t = rel.to_arrow_table() if hasattr(rel, "to_arrow_table") else rel.arrow()
    return check_schema(t, MIX, "mix")


def pretrain_sql(cfg: MixConfig) -> str:
    return f"""SELECT id, 'pretrain' AS mix, CAST({cfg.group_by} AS VARCHAR) AS part, sampling_weight,
        CAST(row_number() OVER (ORDER BY h, id) - 1 AS BIGINT) AS "order" FROM warehouse WHERE NOT ({cfg.pretrain_exclude}) ORDER BY "order" """


def midtrain_sql(cfg: MixConfig, q: dict[str, int]) -> str:
    cases = " ".join(f"WHEN ({p.where}) THEN '{p.name}'" for p in cfg.midtrain)
    limits = " OR ".join(f"(part = '{p.name}' AND k <= {q[p.name]})" for p in cfg.midtrain)
    return f"""WITH labelled AS (SELECT *, CASE {cases} END AS part FROM warehouse),
        ranked AS (SELECT *, row_number() OVER (PARTITION BY part ORDER BY h, id) AS k FROM labelled WHERE part IS NOT NULL)
        SELECT id, 'midtrain' AS mix, part, sampling_weight, CAST(row_number() OVER (ORDER BY h, id) - 1 AS BIGINT) AS "order"
        FROM ranked WHERE {limits or "false"} ORDER BY "order" """


def sft_sql(cfg: MixConfig) -> str:
    return f"""SELECT id, 'sft' AS mix, 'sft' AS part, sampling_weight, CAST(row_number() OVER (ORDER BY {cfg.sft_order}, h, id) - 1 AS BIGINT) AS "order"
        FROM warehouse WHERE {cfg.sft_where} ORDER BY "order" LIMIT {cfg.sft_size}"""


def domain_sql(d: DomainMix) -> str:
    return f"""SELECT id, 'domain_{d.name}' AS mix, '{d.name}' AS part, sampling_weight, CAST(row_number() OVER (ORDER BY {d.order}, h, id) - 1 AS BIGINT) AS "order"
        FROM warehouse WHERE {d.where} ORDER BY "order" LIMIT {d.size}"""


def realized(mix: pa.Table) -> dict[str, dict]:
    n = mix.num_rows
    counts: dict[str, int] = {}
    for p in mix.column("part").to_pylist():
        counts[p] = counts.get(p, 0) + 1
    return {p: {"rows": c, "share": c / n} for p, c in sorted(counts.items())}


def build_mixes(pool: pa.Table, cfg: MixConfig, weights: pa.Table | None = None) -> dict[str, tuple[pa.Table, dict]]:
    """mix name -> (MIX rows, metadata: SQL, configured and realized proportions)."""
    con = warehouse(pool, weights, cfg.seed)
    out = {}
    pre_sql = pretrain_sql(cfg)
    pre = _run(con, pre_sql)
    out["pretrain"] = (
        pre,
        {
            "sql": pre_sql,
            "rows": pre.num_rows,
            "pool_rows": pool.num_rows,
            "built": "bottom-up",
            "proportions": realized(pre),
        },
    )
    q = quotas([(p.name, p.share) for p in cfg.midtrain], cfg.midtrain_size)
    mid_sql = midtrain_sql(cfg, q)
    mid = _run(con, mid_sql)
    got = realized(mid)
    props = {
        p.name: {
            "configured": p.share,
            "quota": q[p.name],
            "rows": got.get(p.name, {}).get("rows", 0),
            "share": got.get(p.name, {}).get("share", 0.0),
            "short": got.get(p.name, {}).get("rows", 0) < q[p.name],
        }
        for p in cfg.midtrain
    }
    out["midtrain"] = (
        mid,
        {"sql": mid_sql, "rows": mid.num_rows, "size": cfg.midtrain_size, "built": "top-down", "proportions": props},
    )
    s_sql = sft_sql(cfg)
    sft = _run(con, s_sql)
    out["sft"] = (
        sft,
        {"sql": s_sql, "rows": sft.num_rows, "size": cfg.sft_size, "built": "curated", "proportions": realized(sft)},
    )
    for d in cfg.domains:  # a domain SFT rung's set (ladder.domains)
        d_sql = domain_sql(d)
        dom = _run(con, d_sql)
        out[f"domain_{d.name}"] = (
            dom,
            {
                "sql": d_sql,
                "rows": dom.num_rows,
                "size": d.size,
                "built": "domain",
                "short": dom.num_rows < d.size,
                "proportions": realized(dom),
            },
        )
    return out


def write_mixes(pool_folder: Path | str, out: Path | str, cfg: MixConfig, weights: Path | str | None = None) -> dict:
    """OUT/<mix>/part-00000.parquet per mix (SQL + proportions in its metadata) and OUT/mixes.json."""
    import pyarrow.parquet as pq

    pool_folder, out = Path(pool_folder), Path(out)
    pool = read_dataset(pool_folder / "kept" if (pool_folder / "kept").is_dir() else pool_folder)
    w = pq.read_table(weights) if weights else None
    mixes = build_mixes(pool, cfg, w)
    meta = {}
    for name, (table, info) in mixes.items():
        table = table.replace_schema_metadata({"kiln.mix": json.dumps(info, sort_keys=True)})
        write_table(table, out / name / "part-00000.parquet")
        meta[name] = info
    (out / "mixes.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return meta


def mixes_of(rewritten: Path, weights: Path | None, out: Path, cfg) -> dict:
    """`kiln mixes` (the `mixes` node): `write_mixes` under the config's `data.mixes`, sampling by `weights`
    (the coverage node's weights.parquet) when given."""
    return write_mixes(rewritten, out, cfg.data.mixes, weights)
