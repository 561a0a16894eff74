"""Asset checks: nothing lost between stages, and the great-expectations suite on each dataset."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq

from assets.expectations import SuiteResult, validate_dataset
from dagster_project.assets import GRAPH
from dagster_project.resources import KilnResource
from kiln.registry import asset_of, data_steps
from kiln.stage import Summary, shard_paths
from kiln.trainshards import is_train_set, read_manifest


def count_rows(dataset: Path) -> int:
    return sum(pq.read_metadata(p).num_rows for p in shard_paths(dataset))


def kept_rows(output: Path) -> int:
    """Rows a stage kept: its kept Parquet's, or the manifest's for the pack stage's train-set shards."""
    return read_manifest(output).rows if is_train_set(output) else count_rows(output / "kept")


def _upstream_rows(kiln: KilnResource, upstream: str) -> int:
    if upstream == "raw_images":  # the source's listing: every object it holds
        return pq.read_metadata(kiln.path("source") / "listing.parquet").num_rows
    return kept_rows(kiln.path(upstream))


def _accounting_check(key: str, upstream: str) -> dg.AssetChecksDefinition:
    @dg.asset_check(
        asset=key,
        name="rows_accounted_for",
        blocking=True,
        description=f"every {upstream} row is in {key} kept or rejected, exactly once",
    )
    def _check(kiln: KilnResource) -> dg.AssetCheckResult:
        out = kiln.path(key)
        s = Summary.read(out)
        kept, rejected, upstream_rows = (
            kept_rows(out),
            count_rows(out / "rejected"),
            _upstream_rows(kiln, upstream),
        )
        ok = s.input_rows == upstream_rows == kept + rejected and (s.kept, s.rejected) == (kept, rejected)
        return dg.AssetCheckResult(
            passed=ok, metadata={"upstream_rows": upstream_rows, "kept": kept, "rejected": rejected}
        )

    return _check


def _suite_metadata(res: SuiteResult) -> dict:
    return {
        "expectations": len(res.outcomes),
        "failed": dg.MetadataValue.json([o.__dict__ for o in res.failed]),
    }


def _expectations_check(key: str, suite: str) -> dg.AssetChecksDefinition:
    @dg.asset_check(
        asset=key,
        name="great_expectations",
        description=f"the great-expectations suite '{suite}' on the kept rows, and 'rejected' on the rejects",
    )
    def _check(kiln: KilnResource) -> dg.AssetCheckResult:
        cfg = kiln.config()
        kept = validate_dataset(kiln.path(key), suite, cfg)
        rej = validate_dataset(kiln.path(key) / "rejected", "rejected", cfg)
        return dg.AssetCheckResult(
            passed=kept.success and rej.success,
            metadata={
                **_suite_metadata(kept),
                "rejected_failed": dg.MetadataValue.json([o.__dict__ for o in rej.failed]),
            },
        )

    return _check


checked = [(n.key, asset_of(n.read_paths[0]), n.suite) for n in data_steps(GRAPH)]
all_checks = [_accounting_check(key, upstream) for key, upstream, _ in checked] + [
    _expectations_check(key, suite) for key, _, suite in checked
]
