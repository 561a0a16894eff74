"""One Dagster asset per node of the registry (kiln.registry), generated: its deps are the nodes it reads, its
code version the node's version inputs (kiln.lineage.node_code_version, what DVC lists as deps and params), its
data version the content hash of its folder (what dvc.lock records), its body the node's command and its page
(dagster_project.node_pages). No asset is written by hand here.

`raw_images` is an observation, not a materialization: listing the source is cheap and its hash is what
marks everything downstream stale when an object changes (the `source_changes` sensor observes it too).
"""

from __future__ import annotations

import dagster as dg

from dagster_project.node_pages import PAGES, NodeRun
from dagster_project.resources import KilnResource
from kiln.commands import OVERWRITE
from kiln.ladder import rungs
from kiln.lineage import default_config, node_code_version
from kiln.memory import release_freed_memory
from kiln.outputs import output_hash
from kiln.registry import Node, asset_of, run_node, with_door

GRAPH = default_config()
NODES = with_door("dagster", GRAPH)
EVAL_SET = rungs(GRAPH)[0].train_set  # the first rung's train set: its held-out rows no rung trained on


def upstream_keys(node: Node) -> list[str]:
    """The assets a node reads (the source listing's observation writes the demo corpus it lists)."""
    return [k for k in dict.fromkeys(asset_of(p) for p in node.read_paths) if k != node.key]


def materialize(node: Node, kiln: KilnResource, log) -> dg.MaterializeResult:
    """Run the node's command into its folder and draw its page."""
    from slurm.jobs import SlurmJobFailed

    cfg = kiln.config_of(node)
    owns_folder = {"overwrite": True} if OVERWRITE in node.cmd.options else {}  # a re-materialization replaces the run
    try:
        result = run_node(node, kiln.data_dir, cfg, log=log, **owns_folder)
    except SlurmJobFailed as e:  # a failed job fails the materialization with its log tail
        raise dg.Failure(
            description=f"slurm job {e.report.job_id} {e.report.state}",
            metadata={**e.report.metadata(), "log_tail": dg.MetadataValue.md(f"```\n{e.report.log_tail}\n```")},
        ) from None
    out = kiln.path(node.folder)
    run = NodeRun(node, cfg, result, out, _inputs(node, kiln), kiln.path(EVAL_SET))
    page = PAGES[node.page](run)
    release_freed_memory()  # `kiln run` runs every asset in one process: the next starts from what is live
    return dg.MaterializeResult(metadata=page, data_version=dg.DataVersion(output_hash(out)))


def _inputs(node: Node, kiln: KilnResource) -> dict:
    from kiln.registry import node_inputs

    return node_inputs(node, kiln.data_dir)


def node_asset(node: Node) -> dg.AssetsDefinition:
    @dg.asset(
        name=node.key,
        deps=upstream_keys(node),
        group_name=node.group,
        kinds=set(node.kinds),
        code_version=node_code_version(node),
        description=node.description,
        op_tags={"kiln/cpus": str(node.resources.cpus), "kiln/gpus": str(node.resources.gpus)},  # what one task needs
    )
    def _asset(context, kiln: KilnResource) -> dg.MaterializeResult:
        return materialize(node, kiln, context.log.info)

    return _asset


def observe_listing(kiln: KilnResource) -> dg.ObserveResult:
    """List the source into data/source (the `raw_images` node) and say what was found; its data version is
    the listing's hash."""
    source = next(n for n in NODES if n.key == "raw_images")
    cfg = kiln.config_of(source)
    report = run_node(source, kiln.data_dir, cfg, raw=str(kiln.path("raw")))
    out = kiln.path(source.folder)
    md = PAGES[source.page](NodeRun(source, cfg, report, out, {}, kiln.path(EVAL_SET)))
    return dg.ObserveResult(data_version=dg.DataVersion(report["version"]), metadata=md)


@dg.observable_source_asset(
    name="raw_images",
    group_name="curation",
    description=next(n.description for n in NODES if n.key == "raw_images"),
    required_resource_keys={"kiln"},
)
def raw_images(context) -> dg.ObserveResult:
    return observe_listing(context.resources.kiln)


ASSETS = {n.key: raw_images if n.key == "raw_images" else node_asset(n) for n in NODES}


def profile_assets(overrides: list[str], keys: list[str]) -> list[dg.AssetsDefinition]:
    """The assets of `keys` in the graph of another profile (the one KILN_OVERRIDES would build)."""
    from kiln.config import load_config
    from kiln.registry import nodes

    return [node_asset(n) for n in nodes(load_config(overrides)) if n.key in keys]
