"""`kiln`: one command line over every stage. Heavy imports happen inside each command."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from kiln.stage_names import add_stage_argument


def _cfg(overrides: list[str]):
    from kiln.config import load_config

    return load_config(overrides)


def cmd_config(args: argparse.Namespace) -> int:
    from kiln.config import to_yaml

    print(to_yaml(_cfg(args.overrides)), end="")
    return 0


def cmd_demo_data(args: argparse.Namespace) -> int:
    from assets.demo_corpus import write_demo_corpus

    cfg = _cfg(args.overrides).data.demo
    n = args.n if args.n is not None else cfg.n
    seed = args.seed if args.seed is not None else cfg.seed
    truth = write_demo_corpus(Path(args.out), n=n, seed=seed, size=cfg.size)
    print(f"wrote {truth.num_rows} files under {Path(args.out) / 'images'}; truth in {Path(args.out) / 'truth.parquet'}")
    return 0


def cmd_source(args: argparse.Namespace) -> int:
    import json

    from assets.source import write_listing
    from kiln.paths import artifact

    report = write_listing(_cfg(args.overrides), Path(args.out), Path(args.raw) if args.raw else artifact("raw"))
    print(json.dumps(report, indent=2, sort_keys=True))
    return 0


def cmd_coverage(args: argparse.Namespace) -> int:
    import json

    from assets.concepts import write_coverage

    print(json.dumps(write_coverage(Path(args.input), Path(args.out), _cfg(args.overrides).data.concepts), indent=2, sort_keys=True, default=str))
    return 0


def cmd_pma(args: argparse.Namespace) -> int:
    from kiln.ladder import pma_k
    from training.final_checkpoint import write_final_checkpoint

    k = args.k or pma_k(_cfg(args.overrides), args.overrides)
    print(write_final_checkpoint(Path(args.run), k, Path(args.out)))
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from training.distributed import init_distributed
    from training.merge import merge_checkpoints

    cfg = _cfg(args.overrides).post.merge
    made = init_distributed("cpu")  # under torchrun: the ranks share the tensors (docs/post-training.md#merging)
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        out = merge_checkpoints([Path(s) for s in args.source], Path(args.base) if args.base else None, Path(args.out), cfg, args.trust_unsigned)
    finally:
        if made:
            dist.destroy_process_group()
    if rank == 0:
        print(out)
    return 0


def cmd_merge_domains(args: argparse.Namespace) -> int:
    import json

    from training.domains import merge_domains

    cfg = _cfg(args.overrides)
    names = [d.name for d in cfg.ladder.domains]
    if len(names) != len(args.source):
        raise SystemExit(f"kiln merge-domains: {len(args.source)} --source for the {len(names)} domains of ladder.domains ({', '.join(names) or 'none'})")
    report = merge_domains(Path(args.base), dict(zip(names, map(Path, args.source), strict=True)), Path(args.out), cfg)
    print(json.dumps(report["scores"], indent=2, sort_keys=True))
    return 0


def cmd_mixes(args: argparse.Namespace) -> int:
    import json

    from assets.mixes import write_mixes

    print(json.dumps(write_mixes(Path(args.input), Path(args.out), _cfg(args.overrides).data.mixes, args.weights), indent=2, sort_keys=True, default=str))
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
        print(f"kiln: {', '.join(stale)} differ from what the lineage generates: run `kiln dvc write`", file=sys.stderr)
        return 1
    print("dvc.yaml and params.yaml are the lineage's" if args.check else "wrote dvc.yaml and params.yaml")
    return 0


def cmd_stage(args: argparse.Namespace) -> int:
    from kiln.executors import execute
    from kiln.outputs import ChecksumError, OutputError
    from kiln.stage import StageInputError

    try:
        s = execute(args.name, args.input, args.output, _cfg(args.overrides), overwrite=args.overwrite)
    except (StageInputError, OutputError, ChecksumError) as e:  # a refusal or a bad input: one plain line, no traceback
        print(f"kiln: {e}", file=sys.stderr)
        return 2
    print(s.to_json(), end="")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from training.dcp import ResumeMismatch
    from training.dcp_safe import UnsafeCheckpoint
    from training.manifest import CheckpointCorrupt, CheckpointUntrusted
    from training.trainer import NonFiniteTraining, train

    try:
        ckpt = train(Path(args.data), Path(args.out), _cfg(args.overrides), resume=args.resume, overwrite=args.overwrite)
    except (FileExistsError, ResumeMismatch, CheckpointCorrupt, CheckpointUntrusted, UnsafeCheckpoint, NonFiniteTraining) as e:  # a refusal: one plain message, no traceback
        print(f"kiln: {e}", file=sys.stderr)
        return 1
    print(f"checkpoint: {ckpt}")
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from training.sampling import sample_to_dir

    expander = Path(args.expand) if args.expand else None
    grid = sample_to_dir(Path(args.checkpoint), Path(args.out), _cfg(args.overrides), prompts_file=args.prompts, expander=expander)
    print(f"sample grid: {grid}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from training.evaluate import evaluate

    metrics = evaluate(Path(args.checkpoint), Path(args.data), Path(args.out), _cfg(args.overrides))
    import json

    print(json.dumps(metrics, indent=2, sort_keys=True))
    return 0


def cmd_pairs(args: argparse.Namespace) -> int:
    import json

    from training.pairs import make_pairs

    print(json.dumps(make_pairs(Path(args.checkpoint), Path(args.out), _cfg(args.overrides)), indent=2, sort_keys=True))
    return 0


def cmd_reward_model(args: argparse.Namespace) -> int:
    import json

    from training.reward_model import train_reward_model

    print(json.dumps(train_reward_model(Path(args.pairs), Path(args.out), _cfg(args.overrides), args.source), indent=2, sort_keys=True))
    return 0


def cmd_dpo(args: argparse.Namespace) -> int:
    from training.dpo_train import dpo

    try:
        print(dpo(Path(args.checkpoint), Path(args.pairs), Path(args.out), _cfg(args.overrides), resume=args.resume, source=args.source, overwrite=args.overwrite))
    except (FileExistsError, ValueError) as e:  # an earlier run's checkpoints in OUT, --resume with --overwrite: one plain message
        print(f"kiln: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_grpo(args: argparse.Namespace) -> int:
    from training.grpo_train import grpo

    try:
        print(grpo(Path(args.checkpoint), Path(args.out), _cfg(args.overrides), resume=args.resume, overwrite=args.overwrite))
    except (FileExistsError, ValueError) as e:  # an earlier run's checkpoints in OUT, --resume with --overwrite: one plain message
        print(f"kiln: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_expander(args: argparse.Namespace) -> int:
    """`kiln expander-sft` and `kiln expander-rl` (docs/expander.md); --evaluate writes OUT/expander_eval.json."""
    import json

    from training.expander import read_pairs, train_sft
    from training.expander_eval import evaluate_expander
    from training.expander_rl import train_rl

    cfg = _cfg(args.overrides)
    checkpoint = Path(args.checkpoint) if args.checkpoint else None
    try:
        if args.fn_name == "sft":
            out = train_sft(read_pairs(Path(args.pairs)), Path(args.out), cfg, resume=args.resume, overwrite=args.overwrite)
        else:
            out = train_rl(Path(args.sft), checkpoint, Path(args.out), cfg, resume=args.resume, overwrite=args.overwrite)
    except (FileNotFoundError, FileExistsError, ValueError) as e:  # a missing model or input, an earlier run's checkpoints in OUT: one plain message
        print(f"kiln: {e}", file=sys.stderr)
        return 1
    if args.evaluate:
        report = evaluate_expander(out, checkpoint, cfg)
        (out / "expander_eval.json").write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps({k: v for k, v in report.items() if k != "examples"}, sort_keys=True))
    print(f"expander: {out}")
    return 0


def cmd_style_train(args: argparse.Namespace) -> int:
    from training.style_eval import evaluate_style_checkpoint
    from training.style_train import style_train

    cfg = _cfg(args.overrides)
    try:
        out = style_train(Path(args.checkpoint), Path(args.out), cfg, resume=args.resume, overwrite=args.overwrite)
    except (FileNotFoundError, FileExistsError, ValueError) as e:  # a missing or unusable checkpoint, an earlier run in OUT: one plain message
        print(f"kiln: {e}", file=sys.stderr)
        return 1
    if args.evaluate:
        import json

        report = evaluate_style_checkpoint(out, cfg)
        (out / "style_eval.json").write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report))
    print(out)
    return 0


def cmd_distill(args: argparse.Namespace) -> int:
    from training.dcp import ResumeMismatch
    from training.dcp_safe import UnsafeCheckpoint
    from training.manifest import CheckpointCorrupt, CheckpointUntrusted
    from training.tdm_train import distill

    try:
        print(distill(Path(args.checkpoint), Path(args.out), _cfg(args.overrides), resume=args.resume, overwrite=args.overwrite))
    except (FileExistsError, ResumeMismatch, CheckpointCorrupt, CheckpointUntrusted, UnsafeCheckpoint) as e:  # a refusal: one plain message
        print(f"kiln: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from dagster_project.run import materialize_all

    select, overrides = args.select, list(args.overrides)
    if select:  # `--select a b key=value`: argparse gives the override to --select; an asset key never holds "="
        overrides += [s for s in select if "=" in s]
        select = [s for s in select if "=" not in s]
    return 0 if materialize_all(overrides, select=select, everything=args.all, job=args.job) else 1


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; `command`: the subcommand asked for, whose deferred parser (DEFERRED) is loaded."""
    p = argparse.ArgumentParser(prog="kiln", description="raw images -> curated datasets -> a trained, evaluated DiT")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("config", help="print the composed, validated config")
    c.add_argument("action", choices=["show"])
    c.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. train.steps=10")
    c.set_defaults(fn=cmd_config)

    d = sub.add_parser("demo-data", help="write the procedural demo corpus with its ground truth")
    d.add_argument("--out", required=True)
    d.add_argument("--n", type=int, default=None)
    d.add_argument("--seed", type=int, default=None)
    d.add_argument("overrides", nargs="*")
    d.set_defaults(fn=cmd_demo_data)

    so = sub.add_parser("source", help="list the configured source (data.source): OUT/listing.parquet + OUT/source.json with its data version")
    so.add_argument("--out", required=True)
    so.add_argument("--raw", default=None, help="where `source: demo` writes the demo corpus (default: data/raw)")
    so.add_argument("overrides", nargs="*")
    so.set_defaults(fn=cmd_source)

    cv = sub.add_parser("coverage", help="concept coverage of a captioned pool: counts, sampling weights, a plot")
    cv.add_argument("--input", required=True, help="a rewrite stage output folder")
    cv.add_argument("--out", required=True)
    cv.add_argument("overrides", nargs="*")
    cv.set_defaults(fn=cmd_coverage)

    mx = sub.add_parser("mixes", help="pretraining, midtraining and SFT mixes as DuckDB queries over a pool")
    mx.add_argument("--input", required=True, help="a rewrite stage output folder")
    mx.add_argument("--out", required=True)
    mx.add_argument("--weights", default=None, help="the coverage weights (OUT/weights.parquet of `kiln coverage`)")
    mx.add_argument("overrides", nargs="*")
    mx.set_defaults(fn=cmd_mixes)

    pm = sub.add_parser("pma", help="the ladder's final checkpoint: the average of a run's last K step checkpoints (PMA)")
    pm.add_argument("--run", required=True, help="the last rung's checkpoint folder (its dcp/ step checkpoints)")
    pm.add_argument("--out", required=True)
    pm.add_argument("--k", type=int, default=None, help="default: the last ladder rung's train.pma_k (at least 1)")
    pm.add_argument("overrides", nargs="*")
    pm.set_defaults(fn=cmd_pma)

    mg = sub.add_parser("merge", help="merge checkpoints of one model (exports or DCP steps) by post.merge.method, streaming tensor by tensor")
    mg.add_argument("--source", action="append", required=True, help="a checkpoint folder or DCP step folder; repeat, in the order of post.merge.weights")
    mg.add_argument("--base", default=None, help="the checkpoint the sources were trained from (every method but linear)")
    mg.add_argument("--out", required=True)
    mg.add_argument("--trust-unsigned", action="store_true", help="read DCP steps whose manifests another key signed")
    mg.add_argument("overrides", nargs="*", help="e.g. post.merge.method=ties post.merge.density=0.3")
    mg.set_defaults(fn=cmd_merge)

    md = sub.add_parser("merge-domains", help="checkpoint_merged: the merge search over the domain SFT checkpoints (ladder.domains), scored per domain")
    md.add_argument("--base", required=True, help="the checkpoint the domain SFTs started from (`checkpoint`)")
    md.add_argument("--source", action="append", required=True, help="a domain SFT checkpoint; repeat, in the order of ladder.domains")
    md.add_argument("--out", required=True)
    md.add_argument("overrides", nargs="*")
    md.set_defaults(fn=cmd_merge_domains)

    dv = sub.add_parser("dvc", help="write dvc.yaml and params.yaml from the lineage (kiln/lineage.py) and the default config")
    dv.add_argument("action", choices=["write"])
    dv.add_argument("--check", action="store_true", help="write nothing; exit 1 when the committed files differ")
    dv.add_argument("overrides", nargs="*", help="a profile and source for DVC, e.g. data=web data.source=s3://bucket/images/")
    dv.set_defaults(fn=cmd_dvc)

    ab = sub.add_parser("ablate", help="run an ablation plan (variants x seeds) as DVC experiments and compare them (docs/ablations.md)")
    ab.add_argument("plan", help="plan YAML, e.g. conf/ablate/demo.yaml")
    ab.add_argument("--out", help="folder for comparison.md/.parquet/.png (default data/ablations/<plan name>)")
    ab.add_argument("--jobs", type=int, default=1, help="experiments run at once (DVC queue workers)")
    ab.add_argument("--force", action="store_true", help="rerun experiments of this plan that already exist")
    ab.set_defaults(fn=cmd_ablate)

    s = sub.add_parser("stage", help="run one data stage: Parquet in, kept + rejected Parquet out (on cluster.executor)")
    add_stage_argument(s, "name")
    s.add_argument("--input", required=True)
    s.add_argument("--output", required=True, help="a new folder, or an earlier kiln stage output (it carries .kiln-output) to replace")
    s.add_argument("--overwrite", action="store_true", help="replace an output folder that holds files kiln did not write (never the input)")
    s.add_argument("overrides", nargs="*")
    s.set_defaults(fn=cmd_stage)

    t = sub.add_parser("train", help="train the DiT on a packed training set")
    t.add_argument("--data", required=True, help="a pack stage output folder")
    t.add_argument("--out", required=True, help="checkpoint folder")
    fresh = t.add_mutually_exclusive_group()
    fresh.add_argument("--resume", action="store_true", help="continue from the newest good checkpoint in OUT/dcp")
    fresh.add_argument("--overwrite", action="store_true", help="replace the checkpoints of an earlier run in OUT (without it, or --resume, a folder with checkpoints is refused)")
    t.add_argument("overrides", nargs="*")
    t.set_defaults(fn=cmd_train)

    sm = sub.add_parser("sample", help="generate a sample grid from a checkpoint")
    sm.add_argument("--checkpoint", required=True)
    sm.add_argument("--out", required=True)
    sm.add_argument("--prompts", default=None, help="text file, one prompt a line (default: the demo prompts)")
    sm.add_argument("--expand", default=None, metavar="EXPANDER_DIR", help="expand each prompt with this prompt expander first (docs/expander.md)")
    sm.add_argument("overrides", nargs="*")
    sm.set_defaults(fn=cmd_sample)

    e = sub.add_parser("eval", help="evaluate a checkpoint against a packed set")
    e.add_argument("--checkpoint", required=True)
    e.add_argument("--data", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("overrides", nargs="*")
    e.set_defaults(fn=cmd_eval)

    pp = sub.add_parser("pairs", help="on-policy preference pairs from a checkpoint, scored by the reward mix (post.*)")
    pp.add_argument("--checkpoint", required=True)
    pp.add_argument("--out", required=True)
    pp.add_argument("overrides", nargs="*")
    pp.set_defaults(fn=cmd_pairs)

    rm = sub.add_parser("reward-model", help="fit the Bradley-Terry aesthetic reward head on preference pairs")
    rm.add_argument("--pairs", required=True)
    rm.add_argument("--out", required=True)
    rm.add_argument("--source", default=None, choices=["on_policy", "human"], help="only pairs of this source")
    rm.add_argument("overrides", nargs="*")
    rm.set_defaults(fn=cmd_reward_model)

    dp = sub.add_parser("dpo", help="Diffusion-DPO from a checkpoint on preference pairs (post.dpo_*)")
    dp.add_argument("--checkpoint", required=True)
    dp.add_argument("--pairs", required=True)
    dp.add_argument("--out", required=True)
    dp.add_argument("--resume", action="store_true")
    dp.add_argument("--overwrite", action="store_true", help="replace the checkpoints of an earlier run in OUT (without it, or --resume, a folder with checkpoints is refused)")
    dp.add_argument("--source", default=None, choices=["on_policy", "human"], help="human: calibration on human labels only")
    dp.add_argument("overrides", nargs="*")
    dp.set_defaults(fn=cmd_dpo)

    g = sub.add_parser("grpo", help="Flow-GRPO from a checkpoint on the configured rewards (post.*)")
    g.add_argument("--checkpoint", required=True)
    g.add_argument("--out", required=True)
    g.add_argument("--resume", action="store_true", help="continue from OUT's newest DCP checkpoint")
    g.add_argument("--overwrite", action="store_true", help="replace the checkpoints of an earlier run in OUT (without it, or --resume, a folder with checkpoints is refused)")
    g.add_argument("overrides", nargs="*")
    g.set_defaults(fn=cmd_grpo)

    st = sub.add_parser("style-train", help="add style references to a checkpoint and train them self-supervised (model.reference.*, style.*)")
    st.add_argument("--checkpoint", required=True)
    st.add_argument("--out", required=True)
    st.add_argument("--resume", action="store_true", help="continue from OUT's newest DCP checkpoint")
    st.add_argument("--overwrite", action="store_true", help="replace the checkpoints of an earlier run in OUT (without it, or --resume, a folder with checkpoints is refused)")
    st.add_argument("--evaluate", action="store_true", help="then score transfer accuracy and leakage per strength (OUT/style_eval.json)")
    st.add_argument("overrides", nargs="*")
    st.set_defaults(fn=cmd_style_train)

    for name, what in (("sft", "fine-tune a causal LM on the user prompts (expander.*)"), ("rl", "GDPO on the SFT expander with faithfulness, image and diversity rewards")):
        ex = sub.add_parser(f"expander-{name}", help=f"prompt expander: {what} (docs/expander.md)")
        if name == "sft":
            ex.add_argument("--pairs", required=True, help="the user_prompts output folder")
        else:
            ex.add_argument("--sft", required=True, help="the expander-sft output folder")
        ex.add_argument("--checkpoint", default=None, help="the DiT that draws expansions (RL's image and diversity rewards, --evaluate)")
        ex.add_argument("--out", required=True)
        ex.add_argument("--resume", action="store_true", help="continue from OUT's newest DCP checkpoint")
        ex.add_argument("--overwrite", action="store_true", help="replace an earlier run's checkpoints in OUT (refused otherwise)")
        ex.add_argument("--evaluate", action="store_true", help="then evaluate on the held-out prompts (OUT/expander_eval.json)")
        ex.add_argument("overrides", nargs="*")
        ex.set_defaults(fn=cmd_expander, fn_name=name)

    ds = sub.add_parser("distill", help="TDM few-step distillation of a checkpoint into a student sampled without CFG (post.distill.*)")
    ds.add_argument("--checkpoint", required=True, help="the teacher checkpoint folder")
    ds.add_argument("--out", required=True)
    ds.add_argument("--resume", action="store_true", help="continue from OUT's newest DCP checkpoint")
    ds.add_argument("--overwrite", action="store_true", help="replace the checkpoints of an earlier run in OUT (without it, or --resume, a folder with checkpoints is refused)")
    ds.add_argument("overrides", nargs="*")
    ds.set_defaults(fn=cmd_distill)

    r = sub.add_parser("run", help="materialize the whole asset graph through Dagster")
    r.add_argument("--select", nargs="*", default=None, help="asset keys (default: the main job, raw images to the evaluation)")
    r.add_argument("--all", action="store_true", help="every asset, the caption and curation-model branches too")
    r.add_argument("--job", default=None, help="a job of the definitions instead of main: post_training, training, curation_models, caption_branch, ...")
    r.add_argument("overrides", nargs="*")
    r.set_defaults(fn=cmd_run)

    from slurm.cli import add_parser as add_submit

    add_submit(sub)

    from kiln.warehouse.cli import add_parsers as add_warehouse

    add_warehouse(sub)

    for name, (module, adder, help) in DEFERRED.items():
        if name == command:
            getattr(importlib.import_module(module), adder)(sub)
        else:
            sub.add_parser(name, help=help)  # listed in `kiln --help`; its own parser loads when it is the command
    _overrides_not_required(p)
    return p


# Subcommands whose parsers live in heavy modules (numpy, duckdb, torch): name -> (module, parser adder, help).
DEFERRED = {
    "review": ("kiln.review", "add_review_parser", "list clusters flagged for review, or approve / reject one"),
    "annotate": ("training.annotate", "add_parser", "label preference pairs in a local page (human calibration), or --export the labels as human pairs"),
    "rubric": ("training.rubric", "add_parser", "a rubric prompt set (post.prompts / post.eval_prompts) from plain prompts, requirements written by an LLM by path"),
}


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
    parser = build_parser(next((a for a in argv if not a.startswith("-")), None))
    # Hydra overrides (key=value, +key=value, ~key) may come before or after the options.
    args, extra = parser.parse_known_args(argv)
    bad = [a for a in extra if a.startswith("-") or ("=" not in a and not a.startswith("~"))]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    if extra:
        args.overrides = [*getattr(args, "overrides", []), *extra]

    from assets.source import SourceError  # after parsing: `kiln --help` and usage errors load none of this
    from kiln.config import ConfigError
    from kiln.errors import UserError
    from kiln.progress import setup_logging

    setup_logging()
    try:
        return args.fn(args)
    except (ConfigError, SourceError, UserError) as e:  # the user's mistake: one line; anything else is a bug
        print(f"kiln: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
