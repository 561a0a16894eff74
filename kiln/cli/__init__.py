"""`kiln`: one command line over the graph. Every command that makes a node of the registry is generated from
its row (kiln.commands: the paths it reads as flags, `--out`, its options, Hydra overrides), so `kiln dpo`
calls exactly what the `checkpoint_dpo` asset and its DVC stage call. Beside them are the commands that make
no node: config, run, dvc, ablate, merge, submit, map, watch, review, annotate, rubric. Heavy imports happen
inside each command; building the parser loads none.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kiln.commands import COMMANDS, Command, resolve

# What every command may raise for a user's mistake: one line, exit 2; anything else is a bug and keeps its traceback.
# A refused output, an input that is missing or holds no shards, a shard changed since its stage wrote it, too.
REFUSALS = (
    "kiln.config:ConfigError",
    "assets.source:SourceError",
    "kiln.errors:UserError",
    "kiln.stage:StageInputError",
    "kiln.outputs:OutputError",
    "kiln.outputs:ChecksumError",
)


def _cfg(overrides: list[str]):
    from kiln.config import load_config

    return load_config(overrides)


def _exceptions(names) -> tuple[type[BaseException], ...]:
    return tuple(resolve(n) for n in names)


def show(result) -> str:
    """What a command prints: a stage's summary as it is, a report as JSON, anything else as itself."""
    if hasattr(result, "to_json"):
        return result.to_json().rstrip("\n")
    if isinstance(result, dict):
        return json.dumps(result, indent=2, sort_keys=True, default=str)
    return str(result)


# ----------------------------------------------------------------------------------- the node commands
def run_command(cmd: Command, args: argparse.Namespace) -> int:
    """`cmd`'s entry on the parsed arguments; its refusals (and kiln's) are one line and exit 2."""
    from kiln.commands import call

    cfg = _cfg(args.overrides)
    positional = [getattr(args, a.name) for a in cmd.positional]
    inputs = {}
    for a in cmd.inputs:
        value = getattr(args, a.name)
        inputs[a.name] = [Path(v) for v in value] if a.many else (Path(value) if value else None)
    options = {}
    for o in cmd.options:
        value = getattr(args, o.name)
        options[o.name] = resolve(o.convert)(value) if o.convert and value is not None else value
    try:
        result = call(cmd, positional, inputs, Path(getattr(args, cmd.out)), cfg, options, log=None)
    except _exceptions(cmd.refusals) as e:
        print(f"kiln: {e}", file=sys.stderr)
        return 2
    print(show(result))
    return 0


def add_command(sub: argparse._SubParsersAction, cmd: Command) -> None:
    p = sub.add_parser(cmd.name, help=cmd.help)
    for a in cmd.positional:
        p.add_argument(
            a.name,
            metavar="STAGE" if a.check else a.name.upper(),
            type=resolve(a.check) if a.check else str,
            help=a.help,
        )
    for a in cmd.inputs:
        p.add_argument(f"--{a.name}", required=a.required, help=a.help, **({"action": "append"} if a.many else {}))
    p.add_argument(f"--{cmd.out}", required=True, help=cmd.out_help)
    groups: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for o in cmd.options:
        if o.exclusive and o.exclusive not in groups:
            groups[o.exclusive] = p.add_mutually_exclusive_group()
        where = groups[o.exclusive] if o.exclusive else p
        flag = f"--{o.name.replace('_', '-')}"
        if o.type == "flag":
            where.add_argument(flag, dest=o.name, action="store_true", help=o.help)
        else:
            where.add_argument(
                flag,
                dest=o.name,
                type=int if o.type == "int" else str,
                choices=o.choices or None,
                default=None,
                help=o.help,
            )
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. train.steps=10")
    p.set_defaults(fn=lambda args, cmd=cmd: run_command(cmd, args))


# ------------------------------------------------------------------------------- the other commands
def cmd_config(args: argparse.Namespace) -> int:
    from kiln.config import to_yaml

    print(to_yaml(_cfg(args.overrides)), end="")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from training.core.distributed import init_distributed
    from training.post.merge import merge_checkpoints

    cfg = _cfg(args.overrides).post.merge
    made = init_distributed("cpu")  # under torchrun: the ranks share the tensors (docs/post-training.md#merging)
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        out = merge_checkpoints(
            [Path(s) for s in args.source],
            Path(args.base) if args.base else None,
            Path(args.out),
            cfg,
            args.trust_unsigned,
        )
    finally:
        if made:
            dist.destroy_process_group()
    if rank == 0:
        print(out)
    return 0


def cmd_ablate(args: argparse.Namespace) -> int:
    from kiln.ablate import ablate

    paths = ablate(Path(args.plan), Path(args.out) if args.out else None, jobs=args.jobs, force=args.force)
    print(paths["markdown"].read_text())
    print("\n".join(f"{k}: {v}" for k, v in paths.items()))
    return 0


def cmd_dvc(args: argparse.Namespace) -> int:
    from kiln.dvcgen import write_dvc_files

    stale = write_dvc_files(check=args.check, overrides=args.overrides)
    if args.check and stale:
        print(
            f"kiln: {', '.join(stale)} differ from what the registry generates: run `kiln dvc write`", file=sys.stderr
        )
        return 1
    print("dvc.yaml and params.yaml are the registry's" if args.check else "wrote dvc.yaml and params.yaml")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from dagster_project.run import materialize_all

    select, overrides = args.select, list(args.overrides)
    if select:  # `--select a b key=value`: argparse gives the override to --select; an asset key never holds "="
        overrides += [s for s in select if "=" in s]
        select = [s for s in select if "=" not in s]
    return 0 if materialize_all(overrides, select=select, everything=args.all, job=args.job) else 1


def add_tools(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("config", help="print the composed, validated config")
    c.add_argument("action", choices=["show"])
    c.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. train.steps=10")
    c.set_defaults(fn=cmd_config)

    r = sub.add_parser(
        "run", help="materialize the asset graph through Dagster (the main job: raw images to an evaluated checkpoint)"
    )
    r.add_argument(
        "--select", nargs="*", default=None, help="asset keys, run as the `select` job (default: the main job)"
    )
    r.add_argument("--all", action="store_true", help="every asset, the branches and post-training too")
    r.add_argument(
        "--job",
        default=None,
        help="a job of the definitions instead of main: post_training, training, expander, style, ...",
    )
    r.add_argument("overrides", nargs="*")
    r.set_defaults(fn=cmd_run)

    dv = sub.add_parser(
        "dvc", help="write dvc.yaml and params.yaml from the registry (kiln/registry.py) and the default config"
    )
    dv.add_argument("action", choices=["write"])
    dv.add_argument("--check", action="store_true", help="write nothing; exit 1 when the committed files differ")
    dv.add_argument(
        "overrides", nargs="*", help="a profile and source for DVC, e.g. data=web data.source=s3://bucket/images/"
    )
    dv.set_defaults(fn=cmd_dvc)

    ab = sub.add_parser(
        "ablate", help="run an ablation plan (variants x seeds) as DVC experiments and compare them (docs/ablations.md)"
    )
    ab.add_argument("plan", help="plan YAML, e.g. conf/ablate/demo.yaml")
    ab.add_argument("--out", help="folder for comparison.md/.parquet/.png (default data/ablations/<plan name>)")
    ab.add_argument("--jobs", type=int, default=1, help="experiments run at once (DVC queue workers)")
    ab.add_argument("--force", action="store_true", help="rerun experiments of this plan that already exist")
    ab.set_defaults(fn=cmd_ablate)

    mg = sub.add_parser(
        "merge",
        help="merge checkpoints of one model (exports or DCP steps) by post.merge.method, streaming tensor by tensor",
    )
    mg.add_argument(
        "--source",
        action="append",
        required=True,
        help="a checkpoint folder or DCP step folder; repeat, in the order of post.merge.weights",
    )
    mg.add_argument(
        "--base", default=None, help="the checkpoint the sources were trained from (every method but linear)"
    )
    mg.add_argument("--out", required=True)
    mg.add_argument("--trust-unsigned", action="store_true", help="read DCP steps whose manifests another key signed")
    mg.add_argument("overrides", nargs="*", help="e.g. post.merge.method=ties post.merge.density=0.3")
    mg.set_defaults(fn=cmd_merge)


def build_parser() -> argparse.ArgumentParser:
    from kiln.cli import annotate, review, rubric, submit, warehouse

    p = argparse.ArgumentParser(prog="kiln", description="raw images -> curated datasets -> a trained, evaluated DiT")
    sub = p.add_subparsers(dest="command", required=True)
    for cmd in COMMANDS.values():
        add_command(sub, cmd)
    add_tools(sub)
    for door in (submit, warehouse, review, annotate, rubric):
        door.add_parser(sub)
    _overrides_not_required(p)
    return p


def _overrides_not_required(parser: argparse.ArgumentParser) -> None:
    """argparse counts a `nargs="*"` positional as required, so a missing STAGE was reported as "overrides is
    required" too; Hydra overrides are always optional."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sp in action.choices.values():
                _overrides_not_required(sp)
        elif action.nargs == "*" and not action.option_strings:
            action.required = False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    # Hydra overrides (key=value, +key=value, ~key) may come before or after the options.
    args, extra = parser.parse_known_args(argv)
    bad = [a for a in extra if a.startswith("-") or ("=" not in a and not a.startswith("~"))]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    if extra:
        args.overrides = [*getattr(args, "overrides", []), *extra]

    from kiln.progress import setup_logging

    setup_logging()
    try:
        return args.fn(args)
    except _exceptions(REFUSALS) as e:  # the user's mistake: one line; anything else is a bug
        print(f"kiln: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
