"""Running a great-expectations suite over an Arrow table, and what a run reports.

Its own module so that both suite modules (assets.expectations, assets.caption_expectations) and the
drift checks (assets.drift) share it without importing each other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pyarrow as pa

os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")


@dataclass(frozen=True)
class ExpectationOutcome:
    expectation: str
    column: str | None
    success: bool
    observed: str


@dataclass(frozen=True)
class SuiteResult:
    suite: str
    success: bool
    outcomes: list[ExpectationOutcome] = field(default_factory=list)

    @property
    def failed(self) -> list[ExpectationOutcome]:
        return [o for o in self.outcomes if not o.success]

    def with_outcomes(self, extra: list[ExpectationOutcome]) -> SuiteResult:
        """This result and checks run outside great-expectations (the drift checks), as one verdict."""
        return SuiteResult(self.suite, self.success and all(o.success for o in extra), [*self.outcomes, *extra])


def run_suite(table: pa.Table, dataset: str, expectations: list) -> SuiteResult:
    """Run expectations over a table with great-expectations (ephemeral context, pandas engine).

    Binary columns (hashes, pixels, embeddings) are dropped first; their sizes are pinned by the Arrow schema."""
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    keep = [f.name for f in table.schema if not (pa.types.is_binary(f.type) or pa.types.is_fixed_size_binary(f.type))]
    df = table.select(keep).to_pandas()
    if df.empty:
        return SuiteResult(dataset, True, [])
    ctx = gx.get_context(mode="ephemeral")
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
    batch = ctx.data_sources.add_pandas("kiln").add_dataframe_asset(dataset).add_batch_definition_whole_dataframe("all")
    suite = ctx.suites.add(gx.ExpectationSuite(name=dataset, expectations=expectations))
    res = ctx.validation_definitions.add(gx.ValidationDefinition(name=dataset, data=batch, suite=suite)).run(
        batch_parameters={"dataframe": df}
    )
    outcomes = []
    for r in res.results:
        conf = r.expectation_config
        observed = r.result.get("unexpected_percent", r.result.get("observed_value", ""))
        column = (
            conf.kwargs.get("column")
            or ",".join(c for c in (conf.kwargs.get("column_A"), conf.kwargs.get("column_B")) if c)
            or None
        )
        outcomes.append(ExpectationOutcome(conf.type, column, bool(r.success), str(observed)))
    return SuiteResult(dataset, bool(res.success), outcomes)
