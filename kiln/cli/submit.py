"""`kiln submit ...`: the Slurm door of the CLI. Wired into kiln/cli/__init__.py with `add_parser(sub)`.

kiln submit train --data D --out O cluster=h200 [overrides]   # prints the job id and its logs
kiln submit selftest --out O cluster=test                     # 2+ task all-reduce SGD: checks the profile
kiln submit stage filter --input I --output O cluster=test    # a data stage as a job array (waits, merges)
kiln submit train ... --dry-run                               # print the sbatch script, submit nothing
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _spec(args: argparse.Namespace, cfg):
    from kiln.executors import train_task
    from slurm.launcher import TaskSpec

    if args.what == "train":
        return train_task(Path(args.data), Path(args.out), cfg)
    return TaskSpec(
        "slurm.selftest:allreduce_sgd", (str(Path(args.out).resolve()),), {"steps": args.steps}, name="kiln-selftest"
    )


def cmd_submit(args: argparse.Namespace) -> int:
    from kiln.config import load_config

    cfg = load_config(args.overrides)
    if args.what == "stage":
        from kiln.executors.slurm_array import run_stage_array

        summary = run_stage_array(
            args.name,
            args.input,
            args.output,
            cfg,
            max_parallel=args.max_parallel,
            log=print,
            overwrite=args.overwrite,
        )
        print(summary.to_json(), end="")
        return 0
    if args.dry_run:
        from slurm.launcher import single_task
        from slurm.profiles import sbatch_script

        spec = _spec(args, cfg)
        shape = cfg.cluster if spec.distributed else single_task(cfg.cluster)
        print(
            sbatch_script(shape, "train", spec.job_name, folder=str(Path(cfg.cluster.log_dir).resolve() / "%j")), end=""
        )
        return 0
    from slurm.jobs import SlurmJobFailed, submit, watch

    job = submit(_spec(args, cfg), cfg.cluster, cfg, log=print)
    print(f"job {job.job_id}: logs in {job.paths.folder} (task 0: {job.paths.stdout})")
    if not args.wait:
        return 0
    try:
        report = watch(job, cfg.cluster, log=print)
    except SlurmJobFailed as e:
        print(e)
        return 1
    print(json.dumps(report.metadata(), indent=2, sort_keys=True))
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("submit", help="run training or a data stage on the cluster profile (cluster=...)")
    what = p.add_subparsers(dest="what", required=True)

    t = what.add_parser("train", help="submit the trainer: nodes x one task per GPU, requeued on preemption")
    t.add_argument("--data", required=True, help="a pack stage output folder")
    t.add_argument("--out", required=True, help="checkpoint folder (the job resumes from it)")

    s = what.add_parser("selftest", help="a small all-reduce SGD job that checks the profile end to end")
    s.add_argument("--out", required=True)
    s.add_argument("--steps", type=int, default=20)

    for sp in (t, s):
        sp.add_argument("--wait", action="store_true", help="wait for the job and print its report")
        sp.add_argument("--dry-run", action="store_true", help="print the sbatch script instead of submitting")
        sp.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. cluster=h200 cluster.nodes=2")

    st = what.add_parser("stage", help="one data stage as a Slurm job array (one task per shard), then merge")
    st.add_argument("name")
    st.add_argument("--input", required=True)
    st.add_argument("--output", required=True)
    st.add_argument(
        "--max-parallel", type=int, default=None, help="array tasks at once (default: cluster.max_array_parallel)"
    )
    st.add_argument("--overwrite", action="store_true", help="replace an existing output folder kiln did not write")
    st.add_argument("overrides", nargs="*")
    p.set_defaults(fn=cmd_submit)
    return p


def main(argv: list[str] | None = None) -> int:
    """`python -m kiln.cli.submit submit ...`: the same subcommand without the rest of the kiln CLI."""
    from kiln.config import ConfigError
    from kiln.progress import setup_logging

    setup_logging()
    parser = argparse.ArgumentParser(prog="kiln")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"kiln: {e}", flush=True)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
