"""The commands that make nodes: `kiln NAME`, each a function of the work layers (assets/, training/) with the
paths it reads, the folder it writes, the config and its options. The CLI builds its subcommands from these
rows, and the registry's nodes (kiln.registry) name the command that makes each; so `kiln dpo`, the
`checkpoint_dpo` asset and its DVC stage call the same function with the same arguments. Light on purpose:
`kiln --help` reads this module and imports no entry.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.stage_names import STAGE_MODULES


@dataclass(frozen=True)
class Arg:
    """A path a command reads: `--name PATH` (`many`: repeated, in order)."""

    name: str
    help: str
    many: bool = False
    required: bool = True
    check: str | None = None  # "module:function" that parses the value (argparse `type`), light to import


@dataclass(frozen=True)
class Option:
    """A setting of a command beyond its paths: `flag` (store_true), or a value of `type` / `choices`."""

    name: str
    help: str
    type: str = "flag"  # flag | int | str
    choices: tuple[str, ...] = ()
    convert: str | None = None  # "module:function" the CLI applies to the value (a path into what the entry takes)
    exclusive: str | None = None  # options of one command sharing this name exclude each other


RESUME = Option("resume", "continue from OUT's newest DCP checkpoint", exclusive="fresh")
OVERWRITE = Option(
    "overwrite",
    "replace the checkpoints of an earlier run in OUT (without it, or --resume, a folder with checkpoints is refused)",
    exclusive="fresh",
)
EVALUATE = Option("evaluate", "then evaluate the result into OUT (what the Dagster asset and the DVC stage do)")
PAIR_SOURCE = Option("source", "only pairs of this source", type="str", choices=("on_policy", "human"))


@dataclass(frozen=True)
class Command:
    """`kiln NAME`: `entry(*positional, *inputs, out, cfg, **options)`; what it returns is printed."""

    name: str
    entry: str  # "package.module:function"
    help: str
    inputs: tuple[Arg, ...] = ()
    out: str = "out"  # the output flag: --out, or --output for a data stage
    out_help: str = "the folder it writes"
    positional: tuple[Arg, ...] = ()  # before the flags: a data stage's name
    options: tuple[Option, ...] = ()
    refusals: tuple[str, ...] = ()  # "module:Exception": this command's user errors beyond kiln's own (kiln.cli)
    log_kwarg: bool = False  # the entry takes `log=` (progress lines of an executor)
    # the modules whose code decides its output (None: the entry's). An executor's own code does not: the
    # same input gives the same output whichever runs it, so a data stage is versioned by its stage module.
    code: tuple[str, ...] | None = None

    @property
    def module(self) -> str:
        return self.entry.partition(":")[0]


CHECKPOINT_REFUSALS = (
    "training.core.dcp:ResumeMismatch",
    "training.core.dcp_safe:UnsafeCheckpoint",
    "training.core.manifest:CheckpointCorrupt",
    "training.core.manifest:CheckpointUntrusted",
    "training.core.runtime:NonFiniteTraining",
    "builtins:FileExistsError",
)
CKPT = Arg("checkpoint", "a checkpoint folder")

COMMANDS = {
    c.name: c
    for c in (
        Command(
            "demo-data",
            "assets.demo_corpus:demo_data",
            "write the procedural demo corpus with its ground truth",
            options=(
                Option("n", "files (default: data.demo.n)", type="int"),
                Option("seed", "default: data.demo.seed", type="int"),
            ),
        ),
        Command(
            "source",
            "assets.source:source_listing",
            "list the configured source (data.source): OUT/listing.parquet + OUT/source.json with its data version",
            options=(Option("raw", "where `source: demo` writes the demo corpus (default: data/raw)", type="str"),),
        ),
        Command(
            "stage",
            "kiln.executors:execute",
            "run one data stage: Parquet in, kept + rejected Parquet out (on cluster.executor)",
            positional=(Arg("name", f"one of: {', '.join(STAGE_MODULES)}", check="kiln.stage_names:stage_name"),),
            inputs=(Arg("input", "a stage output or a dataset folder"),),
            out="output",
            out_help="a new folder, or an earlier kiln stage output (it carries .kiln-output) to replace",
            options=(
                Option("overwrite", "replace an output folder that holds files kiln did not write (never the input)"),
            ),
            log_kwarg=True,
            code=(),
        ),
        Command(
            "coverage",
            "assets.concepts:coverage_of",
            "concept coverage of a captioned pool: counts, sampling weights, a plot",
            inputs=(Arg("input", "a rewrite stage output folder"),),
        ),
        Command(
            "mixes",
            "assets.mixes:mixes_of",
            "pretraining, midtraining and SFT mixes as DuckDB queries over a pool",
            inputs=(
                Arg("input", "a rewrite stage output folder"),
                Arg("weights", "the coverage weights (OUT/weights.parquet of `kiln coverage`)", required=False),
            ),
        ),
        Command(
            "train",
            "kiln.executors:run_training",
            "train the DiT on a packed training set (a Slurm job on a Slurm profile)",
            inputs=(Arg("data", "a pack stage output folder"),),
            out_help="checkpoint folder",
            options=(RESUME, OVERWRITE),
            refusals=CHECKPOINT_REFUSALS,
            log_kwarg=True,
            code=("training.core.trainer",),
        ),
        Command(
            "pma",
            "training.core.final_checkpoint:final_checkpoint",
            "the ladder's final checkpoint: the average of a run's last K step checkpoints (PMA)",
            inputs=(Arg("run", "the last rung's checkpoint folder (its dcp/ step checkpoints)"),),
            options=(Option("k", "step checkpoints to average (default: train.pma_k, at least 1)", type="int"),),
        ),
        Command(
            "sample",
            "training.evaluation.sampling:sample_to_dir",
            "generate a sample grid from a checkpoint",
            inputs=(CKPT,),
            options=(
                Option("prompts", "text file, one prompt a line (default: the demo prompts)", type="str"),
                Option(
                    "expand",
                    "expand each prompt with the prompt expander in this folder first (docs/expander.md)",
                    type="str",
                    convert="training.expander.sft:expander_from",
                ),
            ),
        ),
        Command(
            "eval",
            "training.evaluation.evaluate:evaluate",
            "evaluate a checkpoint against a packed set's held-out rows",
            inputs=(CKPT, Arg("data", "a pack stage output folder")),
        ),
        Command(
            "merge-domains",
            "training.post.domains:merge_domain_checkpoints",
            "checkpoint_merged: the merge search over the domain SFT checkpoints (ladder.domains), scored per domain",
            inputs=(
                Arg("base", "the checkpoint the domain SFTs started from (`checkpoint`)"),
                Arg("source", "a domain SFT checkpoint; repeat, in the order of ladder.domains", many=True),
            ),
        ),
        Command(
            "pairs",
            "training.post.pairs:make_pairs",
            "on-policy preference pairs from a checkpoint, scored by the reward mix (post.*)",
            inputs=(CKPT,),
        ),
        Command(
            "reward-model",
            "training.post.reward_model:train_reward_model",
            "fit the Bradley-Terry aesthetic reward head on preference pairs",
            inputs=(Arg("pairs", "a preference pairs folder"),),
            options=(PAIR_SOURCE,),
        ),
        Command(
            "dpo",
            "training.post.dpo:dpo",
            "Diffusion-DPO from a checkpoint on preference pairs (post.dpo_*)",
            inputs=(CKPT, Arg("pairs", "a preference pairs folder")),
            options=(RESUME, OVERWRITE, PAIR_SOURCE),
            refusals=(*CHECKPOINT_REFUSALS, "builtins:ValueError"),
        ),
        Command(
            "grpo",
            "training.post.grpo:grpo",
            "Flow-GRPO from a checkpoint on the configured rewards (post.*)",
            inputs=(CKPT,),
            options=(RESUME, OVERWRITE),
            refusals=(*CHECKPOINT_REFUSALS, "builtins:ValueError"),
        ),
        Command(
            "distill",
            "training.post.distill:distill",
            "TDM few-step distillation of a checkpoint into a student sampled without CFG (post.distill.*)",
            inputs=(Arg("checkpoint", "the teacher checkpoint folder"),),
            options=(RESUME, OVERWRITE),
            refusals=CHECKPOINT_REFUSALS,
        ),
        Command(
            "style-train",
            "training.style.commands:style_command",
            "add style references to a checkpoint and train them self-supervised (model.reference.*, style.*)",
            inputs=(CKPT,),
            options=(RESUME, OVERWRITE, EVALUATE),
            refusals=(*CHECKPOINT_REFUSALS, "builtins:FileNotFoundError", "builtins:ValueError"),
        ),
        Command(
            "expander-sft",
            "training.expander.commands:expander_sft",
            "prompt expander: fine-tune a causal LM on the user prompts (expander.*; docs/expander.md)",
            inputs=(
                Arg("pairs", "the user_prompts output folder"),
                Arg("checkpoint", "the DiT its evaluation draws with", required=False),
            ),
            options=(RESUME, OVERWRITE, EVALUATE),
            refusals=(*CHECKPOINT_REFUSALS, "builtins:FileNotFoundError", "builtins:ValueError"),
        ),
        Command(
            "expander-rl",
            "training.expander.commands:expander_rl",
            "prompt expander: GDPO on the SFT expander with faithfulness, image and diversity rewards",
            inputs=(
                Arg("sft", "the expander-sft output folder"),
                Arg(
                    "checkpoint",
                    "the DiT that draws expansions (RL's image and diversity rewards, --evaluate)",
                    required=False,
                ),
            ),
            options=(RESUME, OVERWRITE, EVALUATE),
            refusals=(*CHECKPOINT_REFUSALS, "builtins:FileNotFoundError", "builtins:ValueError"),
        ),
    )
}


def resolve(entry: str):
    """The function `package.module:function` names (imported now: the doors list commands without it)."""
    import importlib

    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name)


def call(cmd: Command, positional: list, inputs: dict[str, object], out, cfg, options: dict, log=None):
    """`cmd`'s entry on these arguments: what `kiln COMMAND`, a Dagster asset and a DVC stage all run."""
    kwargs = {k: v for k, v in options.items() if v is not None and v is not False}
    if cmd.log_kwarg and log is not None:
        kwargs["log"] = log
    return resolve(cmd.entry)(*positional, *(inputs.get(a.name) for a in cmd.inputs), out, cfg, **kwargs)
