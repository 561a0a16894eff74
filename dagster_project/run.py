"""`kiln run`: execute a job of `dagster_project.definitions` in-process, as the UI would launch it.

The default is the `main` job, so its runs are recorded under `main` in the instance at DAGSTER_HOME
(default `.dagster/`), and `dagster dev` shows them afterwards. `--select` and `--all` run an ad hoc job
over the same definitions. The config and the source are checked before any asset runs; the
overrides reach the assets as the `kiln` resource's run config, as from the launchpad.
"""

from __future__ import annotations

import logging
import os
import shlex
from pathlib import Path

import dagster as dg

from assets.source import check_source, source_uris
from dagster_project.progress import QUIET_CONSOLE
from dagster_project.resources import KilnResource
from kiln.config import ConfigError
from kiln.paths import data_dir


def dagster_home() -> Path:
    home = Path(os.environ.setdefault("DAGSTER_HOME", str(Path.cwd() / ".dagster")))
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "dagster.yaml").exists():
        (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    return home


def job_for(select: list[str] | None, everything: bool, job: str | None = None) -> dg.JobDefinition:
    """A job of the definitions (`main` by default, or `job`: post_training, training, ...), or the `select`
    job narrowed to the named assets (every asset with `everything`): its runs are listed under that job."""
    from dagster_project import definitions as d

    if job:
        names = [j.name for j in d.defs.jobs if not j.name.startswith("__")]
        if job not in names:
            raise ConfigError(f"no job {job!r}; jobs: {', '.join(names)}")
        return d.defs.resolve_job_def(job)
    if not select and not everything:
        return d.defs.resolve_job_def("main")
    known = {a.key.to_user_string() for a in d.all_assets}
    unknown = sorted(set(select or []) - known)
    if unknown:
        raise ConfigError(f"no asset {', '.join(map(repr, unknown))}; assets: {', '.join(sorted(known))}")
    keys = [dg.AssetKey(k) for k in select] if select else [a.key for a in d.all_assets]
    return d.defs.resolve_job_def("select").get_subset(asset_selection=set(keys))


def unselected_parents(select: list[str]) -> dict[str, list[str]]:
    """For each selected asset, the assets it reads that the selection leaves out: Dagster runs only what
    is selected, so these must already be materialized (the usual cause of a selected step's missing input)."""
    from dagster_project import definitions as d

    graph, chosen = d.defs.resolve_asset_graph(), set(select)
    out = {}
    for key in select:
        parents = sorted(
            k.to_user_string() for k in graph.get(dg.AssetKey(key)).parent_keys
        )  # job_for checked the keys
        if missing := [p for p in parents if p not in chosen]:
            out[key] = missing
    return out


def check_graph_profile(cfg) -> None:
    """The definitions' ladder is the one this run's config asks for (they are built once per process)."""
    from kiln.ladder import all_rungs
    from kiln.lineage import default_config

    built, asked = [r.name for r in all_rungs(default_config())], [r.name for r in all_rungs(cfg)]
    if built != asked:
        raise ConfigError(
            f"the Dagster graph was built for the ladder {built}, this run asks for {asked}: set KILN_OVERRIDES to the run's overrides before the definitions load"
        )


def materialize_all(
    overrides: list[str] | None = None,
    select: list[str] | None = None,
    everything: bool = False,
    job: str | None = None,
) -> bool:
    """The main job by default (raw images to an evaluated checkpoint); `select` names assets; `everything` adds the branches."""
    resource = KilnResource(overrides=list(overrides or []), data_dir=str(data_dir()))
    cfg = resource.config()  # a config that cannot run fails here, before any asset
    os.environ["KILN_OVERRIDES"] = shlex.join(
        resource.overrides
    )  # the graph (its ladder, its code versions) is this profile's
    check_graph_profile(cfg)
    check_source([u for u in source_uris(cfg.data.source) if u != "demo"])  # and so does a source that cannot be read
    logging.getLogger().setLevel(
        logging.WARNING
    )  # one line per asset says it (progress.py); details stay in the event log
    chosen = job_for(select, everything, job)  # an unknown job or asset is refused before anything is created
    dagster_home()
    result = chosen.execute_in_process(
        run_config={
            "resources": {"kiln": {"config": {"overrides": resource.overrides, "data_dir": resource.data_dir}}},
            **QUIET_CONSOLE,
        },
        instance=dg.DagsterInstance.get(),
        tags={"kiln/entry": "kiln run"},
        raise_on_error=False,
    )
    if not result.success and select and (left_out := unselected_parents(select)):
        reads = "; ".join(f"{k} reads {', '.join(v)}" for k, v in left_out.items())
        print(
            f"kiln run: --select runs only the assets it names ({reads}): add any of those not yet materialized to --select"
        )
    failed_checks = [c for c in result.get_asset_check_evaluations() if not c.passed]
    for c in failed_checks:
        print(f"asset check failed: {c.asset_key.to_user_string()} {c.check_name}")
    return result.success and not failed_checks
