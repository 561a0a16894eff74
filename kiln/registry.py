"""The registry: every node of the graph, once. The doors are generated from it: the Dagster asset with its code
and data versions (dagster_project.assets) and the DVC stage with its deps, params and outs (kiln.dvcgen); each
node names the `kiln` command that makes it (kiln.commands, from which kiln.cli builds its subcommands). Adding a
node is one `Node` row here and one function in assets/ or training/; no door is wired by hand.

A `Node` is one artifact of the graph: the command that makes it, which artifact under the data root each of the
command's arguments reads, the config sections that change it, the code it runs beyond its command's module, its
rung (whose overrides shape its config), its Dagster group and page, and what one task of it needs.

What decides a node's output besides its input data is the same for every door (kiln.lineage.version_inputs):
the code files its modules import, the files outside the data root it reads (conf/train/*.yaml), its config
sections and its own call. Dagster hashes them into the code version, DVC lists them as deps, params and the
command line; tests/test_registry.py holds the two to the registry.

The graph is the one of the profile it is built for (kiln.lineage.graph_overrides): the rungs come from
`ladder`, and a source other than the demo has no `demo_corpus`. No Dagster import here.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.commands import COMMANDS, Command, call
from kiln.ladder import (
    FINAL,
    MERGED,
    Rung,
    all_rungs,
    checkpoint_overrides,
    post_base,
    rung_base,
    rungs,
    train_set_overrides,
)
from kiln.stage import StageResources
from kiln.stage_names import STAGE_MODULES

# The data root in the call that versions a node (each door runs it with its own: DVC `data`, Dagster the resource's).
# A plain word: it must parse as a Hydra override value, since the versions compose the config with it.
DATA = "DATA_ROOT"
DOORS = frozenset({"cli", "dagster", "dvc"})


@dataclass(frozen=True)
class Node:
    """One artifact: its key (the Dagster asset, the DVC stage, the folder under the data root) and how it is made."""

    key: str
    command: str  # a key of COMMANDS
    inputs: tuple[tuple[str, tuple[str, ...]], ...]  # (argument, paths under the data root it reads)
    params: tuple[str, ...]  # config sections (dotted) that change its output
    group: str  # Dagster group
    description: str
    positional: tuple[str, ...] = ()  # the command's positional values (a data stage's name)
    options: tuple[tuple[str, object], ...] = ()  # option values every door passes (evaluate=True)
    code: tuple[str, ...] = ()  # modules it runs beyond its command's entry module (their imports follow)
    files: tuple[str, ...] = ()  # files outside the data root it reads (conf/train/*.yaml, a concept list)
    reads: tuple[str, ...] = ()  # paths under the data root its config makes it read (coverage weights, ground truth)
    rung: Rung | None = None
    wiring: str | None = None  # how `rung` shapes its config: train_set | checkpoint | last_rung (kiln.ladder)
    suite: str | None = None  # great-expectations suite of its kept rows (data steps)
    page: str | None = None  # how its Dagster page is drawn (dagster_project.node_pages.PAGES)
    kinds: tuple[str, ...] = ("python",)
    doors: frozenset[str] = DOORS
    extra_outs: tuple[str, ...] = ()  # outputs outside its folder that persist across runs (the evaluation history)
    always_changed: bool = False  # DVC reruns it every time (an observation of the source)
    out_root: str | None = None  # the folder under the data root it writes, when not its key
    gpus: int | None = None  # GPUs one task uses on a GPU profile; default: one for a node that runs a torch model

    @property
    def folder(self) -> str:
        return self.out_root or self.key

    @property
    def resources(self) -> StageResources:
        """What one task of the node needs: a data stage's worker as its stage declares it, a model node one
        GPU per task (training: one task per GPU of the profile's nodes, kiln.executors.train_task)."""
        if self.command == "stage":
            from kiln.stage import get_stage

            return get_stage(self.positional[0]).resources
        return StageResources(cpus=1, gpus=self.gpus if self.gpus is not None else int("pytorch" in self.kinds))

    @property
    def cmd(self) -> Command:
        return COMMANDS[self.command]

    @property
    def modules(self) -> tuple[str, ...]:
        own = (self.cmd.module,) if self.cmd.code is None else self.cmd.code
        return (*own, *self.code)

    def paths(self, arg: str) -> tuple[str, ...]:
        return dict(self.inputs).get(arg, ())

    @property
    def read_paths(self) -> list[str]:
        """Everything under the data root it reads, arguments first."""
        return list(dict.fromkeys([p for _, ps in self.inputs for p in ps] + list(self.reads)))

    def overrides(self, user: list[str], data_root: str) -> list[str]:
        """The config overrides this node composes: the user's, shaped by its rung (kiln.ladder)."""
        if self.rung is None:
            return list(user)
        wire = {"train_set": train_set_overrides, "checkpoint": checkpoint_overrides}.get(self.wiring)
        return wire(self.rung, user, data_root) if wire else rung_base(self.rung, user)


def asset_of(path: str) -> str:
    """The node that writes a path under the data root: its first folder, and the source listing's
    observation for the listing and the demo corpus (data/source, data/raw)."""
    top = path.split("/")[0]
    return "raw_images" if top in ("source", "raw") else top


# ------------------------------------------------------------------------------------------------ the graph
def _stage(
    key: str,
    stage: str,
    upstream: str,
    group: str,
    suite: str,
    params: tuple[str, ...],
    reads_path: str | None = None,
    **kw,
) -> Node:
    return Node(
        key,
        "stage",
        (("input", (reads_path or upstream,)),),
        params,
        group,
        f"`kiln stage {stage}` over {upstream}: kept rows + rejected rows with reasons.",
        positional=(stage,),
        code=(STAGE_MODULES[stage],),
        suite=suite,
        page="stage",
        kinds=("python", "parquet"),
        **kw,
    )


def curation_nodes(cfg) -> list[Node]:
    """The main chain of data steps: each reads its upstream's kept rows; nothing beside it feeds training."""
    truth = [cfg.data.caption.truth] if cfg.data.caption.captioner == "scene_metadata" else []
    in_data = [t for t in truth if t.startswith("data/")]  # the demo's ground truth, written beside its corpus
    truth_reads = {
        "reads": tuple(t.removeprefix("data/") for t in in_data),
        "files": tuple(t for t in truth if t not in in_data),
    }
    return [
        _stage(
            "manifest",
            "ingest",
            "raw_images",
            "curation",
            "manifest",
            ("data.ingest",),
            reads_path="source/listing.parquet",
        ),
        _stage("filtered", "filter", "manifest", "curation", "filtered", ("data.filters",)),
        _stage("deduped", "dedup", "filtered", "curation", "deduped", ("data.dedup",)),
        _stage("embedded", "embed", "deduped", "curation_models", "embedded", ("data.embed",)),
        _stage("classified", "classify", "embedded", "curation_models", "embedded", ("data.classify",)),
        _stage("saed", "sae", "classified", "curation_models", "embedded", ("data.sae",)),
        _stage(
            "clustered",
            "cluster",
            "saed",
            "curation_models",
            "clustered",
            ("data.clustering", "data.caption"),
            **truth_reads,
        ),
        _stage(
            "semdeduped", "semdedup", "clustered", "curation_models", "deduped", ("data.clustering.semdedup_threshold",)
        ),
        _stage("ocr", "ocr", "semdeduped", "captions", "ocred", ("data.ocr",)),
        _stage("text_filtered", "text_filter", "ocr", "captions", "ocred", ("data.ocr",)),
        _stage(
            "captioned",
            "caption_ocr",
            "text_filtered",
            "captions",
            "ocr_captioned",
            ("data.caption", "data.ocr.engine"),
            **truth_reads,
        ),
        _stage("rewritten", "rewrite", "captioned", "captions", "rewritten", ("data.rewrite",)),
    ]


def train_files(name: str) -> list[str]:
    """conf/train/<name>.yaml and the files of its group its Hydra `defaults` pull in (a shared base), bases first."""
    import yaml

    from kiln.paths import REPO_ROOT

    path = REPO_ROOT / "conf" / "train" / f"{name}.yaml"
    data = yaml.safe_load(path.read_text()) if path.is_file() else None
    bases = [b for b in (data or {}).get("defaults", []) if isinstance(b, str) and b != "_self_"]
    return [f for base in bases for f in train_files(base)] + [f"conf/train/{name}.yaml"]


# What `kiln train` and `kiln eval` read: `dvc exp run -S train.steps=50` must rerun them.
TRAIN_PARAMS = ("model", "train", "ladder", "data.rewrite.form_probs")
EVAL_PARAMS = (
    "train.eval",
    "train.sample",
    "train.timestep_shift",
    "train.timestep_max_shift",
    "metrics",
    "post.judge",
    "post.eval_prompts",
)


# what the pack stage reads of the model: whole-token bucket sides (assets.pack.side_step)
PACK_MODEL_PARAMS = ("model.autoencoder", "model.autoencoder_path", "model.patch_size")


def rung_nodes(r: Rung) -> list[Node]:
    """A rung's train set (the pack stage over rewritten at the rung's resolution and mix) and its checkpoint
    (the trainer on it, from the previous rung's weights)."""
    group, files = ("post_training" if r.domain else "training"), tuple(train_files(r.train))
    pack = Node(
        r.train_set,
        "stage",
        (("input", ("rewritten",)),),
        ("data.pack", "ladder", "train", *PACK_MODEL_PARAMS),
        group,
        f"`kiln stage pack` over rewritten for the {r.name} rung: its resolution, its mix, the coverage weights; packed by aspect bucket.",
        positional=("pack",),
        code=(STAGE_MODULES["pack"],),
        files=files,
        reads=("coverage", "mixes"),
        rung=r,
        wiring="train_set",
        suite="train_set",
        page="stage",
        kinds=("python", "parquet"),
    )
    start = f", from {r.start}'s weights" if r.start else ""
    ckpt = Node(
        r.checkpoint,
        "train",
        (("data", (r.train_set,)),),
        TRAIN_PARAMS,
        group,
        f"The {r.name} rung: the trainer on {r.train_set} (conf/train/{r.train}.yaml{' + overrides' if r.overrides else ''}){start}.",
        files=files,
        reads=(r.start,) if r.start else (),
        rung=r,
        wiring="checkpoint",
        page="checkpoint",
        kinds=("pytorch", "safetensors"),
    )
    return [pack, ckpt]


def training_nodes(cfg) -> list[Node]:
    ladder = rungs(cfg)
    last, eval_set = ladder[-1], ladder[0].train_set  # the first rung's held-out rows: no rung trained on them
    return [
        *(n for r in ladder for n in rung_nodes(r)),
        Node(
            FINAL,
            "pma",
            (("run", (last.checkpoint,)),),
            ("ladder", "train.pma_k"),
            "training",
            f"The model: PMA, the average of {last.checkpoint}'s last train.pma_k step checkpoints (in place of an EMA).",
            files=tuple(train_files(last.train)),
            rung=last,
            wiring="last_rung",
            page="final_checkpoint",
            kinds=("pytorch", "safetensors"),
        ),
        Node(
            "samples",
            "sample",
            (("checkpoint", (FINAL,)),),
            ("train.sample",),
            "evaluation",
            "A grid of samples per demo prompt from the checkpoint.",
            page="samples",
            kinds=("pytorch", "image"),
        ),
        Node(
            "evaluation",
            "eval",
            (("checkpoint", (FINAL,)), ("data", (eval_set,))),
            EVAL_PARAMS,
            "evaluation",
            f"Held-out flow loss on {eval_set}'s held-out rows, prompt following vs an untrained model, throughput.",
            page="evaluation",
            kinds=("pytorch",),
            extra_outs=(cfg.metrics.history,) if cfg.metrics.history else (),
            out_root="eval",
        ),
    ]


def post_nodes(cfg) -> list[Node]:
    """After `checkpoint`, the Krea 2 order: domain SFTs and their merge, preference pairs -> reward model,
    Diffusion-DPO, Flow-GRPO from DPO, then the few-step TDM student from GRPO."""
    domains, base = [r for r in all_rungs(cfg) if r.domain], post_base(cfg)
    g, ckpt = "post_training", ("pytorch", "safetensors")
    merged = (
        [
            Node(
                MERGED,
                "merge-domains",
                (("base", (FINAL,)), ("source", tuple(r.checkpoint for r in domains))),
                ("post.merge", "ladder", "train.eval", "train.sample"),
                g,
                f"The merge of {', '.join(r.checkpoint for r in domains)} against `checkpoint` (post.merge: method, weights, density, and a search over "
                "candidate weights); per-domain scores of every domain SFT, the base and the merge first.",
                code=("training.post.merge",),
                page="merged",
                kinds=ckpt,
            ),
        ]
        if domains
        else []
    )
    return [
        *(n for r in domains for n in rung_nodes(r)),
        *merged,
        Node(
            "preference_pairs",
            "pairs",
            (("checkpoint", (base,)),),
            ("post", "train.sample"),
            g,
            f"On-policy preference pairs: K samples per prompt from `{base}`, scored by the reward mix (post.rewards); best vs worst above post.pair_margin.",
            page="report",
            kinds=("pytorch", "parquet"),
        ),
        Node(
            "reward_model",
            "reward-model",
            (("pairs", ("preference_pairs",)),),
            ("data.embed",),
            g,
            "The aesthetic reward model: a Bradley-Terry head on the image embedder, fit on the pairs; held-out pair accuracy first.",
            page="reward_model",
            kinds=("numpy",),
        ),
        Node(
            "checkpoint_dpo",
            "dpo",
            (("checkpoint", (base,)), ("pairs", ("preference_pairs",))),
            ("post",),
            g,
            f"Diffusion-DPO from `{base}` on the pairs, with the divergence guard; prompt following before/after first.",
            page="dpo",
            kinds=ckpt,
        ),
        Node(
            "checkpoint_grpo",
            "grpo",
            (("checkpoint", ("checkpoint_dpo",)),),
            ("post",),
            g,
            "Flow-GRPO from `checkpoint_dpo` on the reward mix, without CFG; prompt following before/after and reward means first.",
            page="grpo",
            kinds=ckpt,
        ),
        Node(
            "checkpoint_student",
            "distill",
            (("checkpoint", ("checkpoint_grpo",)),),
            ("post",),
            g,
            "The few-step student: TDM distillation of `checkpoint_grpo` (post.distill), sampled with its own steps and no CFG; the student against "
            "the teacher at its own steps and the teacher sampled naively with the student's steps, first.",
            page="student",
            kinds=ckpt,
        ),
    ]


def branch_nodes(cfg) -> list[Node]:
    """Beside the chain: prompt pairs and user prompts for the expander, the expander, style references."""
    return [
        _stage("prompt_pairs", "prompt_pairs", "rewritten", "captions", "prompt_pairs", ("data.rewrite",)),
        _stage("user_prompts", "user_prompts", "prompt_pairs", "captions", "prompt_pairs", ("data.user_prompts",)),
        Node(
            "expander_sft",
            "expander-sft",
            (("pairs", ("user_prompts",)), ("checkpoint", (FINAL,))),
            ("expander",),
            "expander",
            "The prompt expander after SFT on (user prompt -> long caption), loss on the caption only; faithfulness, prompt following short vs "
            "expanded and diversity first.",
            options=(("evaluate", True),),
            page="expander",
            kinds=("pytorch", "safetensors"),
        ),
        Node(
            "expander_rl",
            "expander-rl",
            (("sft", ("expander_sft",)), ("checkpoint", (FINAL,))),
            ("expander",),
            "expander",
            "The prompt expander after GDPO (faithfulness, image and diversity rewards; safety gate) from expander_sft; the same evaluation first.",
            options=(("evaluate", True),),
            page="expander",
            kinds=("pytorch", "safetensors"),
        ),
        Node(
            "checkpoint_style",
            "style-train",
            (("checkpoint", (FINAL,)),),
            ("model.reference", "style"),
            "style",
            "`checkpoint` with style references (model.reference), trained on same-style-family pairs (style); transfer accuracy and leakage per strength first.",
            options=(("evaluate", True),),
            page="style",
            kinds=("pytorch", "safetensors"),
        ),
    ]


def source_nodes(cfg) -> list[Node]:
    """The source, observed: in Dagster an observation (its data version is the listing's hash) that also
    writes the demo corpus; in DVC the demo corpus is a stage of its own and the listing always reruns."""
    sources = [cfg.data.source] if isinstance(cfg.data.source, str) else list(cfg.data.source or [])
    demo = (
        [
            Node(
                "demo_corpus",
                "demo-data",
                (),
                ("data.demo",),
                "curation",
                "The procedural demo corpus with its ground truth (data/raw).",
                doors=frozenset({"cli", "dvc"}),
                out_root="raw",
            )
        ]
        if "demo" in sources
        else []
    )
    listing = Node(
        "raw_images",
        "source",
        (),
        ("data.source",),
        "curation",
        "The raw images where they are (`data.source`: the demo corpus, a folder, an object-store prefix, WebDataset shards, a .txt or "
        "Parquet list), observed: listed with each object's size and version into data/source/listing.parquet. Its data version is the "
        "listing's hash, so a new, changed or removed object marks manifest and everything after it stale.",
        reads=("raw",) if demo else (),
        page="source",
        always_changed=True,
        out_root="source",
    )
    return [*demo, listing]


def nodes(cfg) -> list[Node]:
    """Every node of the graph the config describes, upstream first."""
    return [
        *source_nodes(cfg),
        *curation_nodes(cfg),
        *pool_nodes(cfg),
        *training_nodes(cfg),
        *post_nodes(cfg),
        *branch_nodes(cfg),
    ]


def pool_nodes(cfg) -> list[Node]:
    """Over the captioned pool: concept coverage (sampling weights) and the mixes the rungs train on."""
    return [
        Node(
            "coverage",
            "coverage",
            (("input", ("rewritten",)),),
            ("data.concepts",),
            "captions",
            "Concept coverage of the captions: per-concept counts, sampling weights that raise rare concepts, a plot.",
            files=(cfg.data.concepts.path,),
            page="coverage",
            kinds=("duckdb",),
        ),
        Node(
            "mixes",
            "mixes",
            (("input", ("rewritten",)), ("weights", ("coverage/weights.parquet",))),
            ("data.mixes",),
            "captions",
            "Pretraining, midtraining and SFT mixes as DuckDB queries over the pool, proportions recorded.",
            page="mixes",
            kinds=("duckdb", "parquet"),
        ),
    ]


def node(key: str, cfg) -> Node:
    found = {n.key: n for n in nodes(cfg)}
    if key not in found:
        from kiln.errors import UnknownName

        raise UnknownName(f"no node {key!r}; nodes: {', '.join(found)}")
    return found[key]


def data_steps(cfg) -> list[Node]:
    """The nodes made by a data stage (`kiln stage`): their checks count rows and run a suite."""
    return [n for n in nodes(cfg) if n.command == "stage"]


def with_door(door: str, cfg) -> list[Node]:
    return [n for n in nodes(cfg) if door in n.doors]


# --------------------------------------------------------------------------------------------- running
def node_inputs(node: Node, data_root) -> dict[str, object]:
    """The node's command arguments as paths under `data_root` (a list for a repeated argument)."""
    from pathlib import Path

    root, out = Path(data_root), {}
    for arg in node.cmd.inputs:
        paths = [root / p for p in node.paths(arg.name)]
        out[arg.name] = paths if arg.many else (paths[0] if paths else None)
    return out


def run_node(node: Node, data_root, cfg, log=None, **door_options):
    """Make the node under `data_root` with `cfg` (composed with `node.overrides`)."""
    from pathlib import Path

    options = {**dict(node.options), **door_options}
    return call(
        node.cmd, list(node.positional), node_inputs(node, data_root), Path(data_root) / node.folder, cfg, options, log
    )


def main_nodes(cfg) -> list[Node]:
    """What `kiln run` makes by default (the `main` job): the source to an evaluated checkpoint."""
    return [
        n
        for n in [*source_nodes(cfg), *curation_nodes(cfg), *pool_nodes(cfg), *training_nodes(cfg)]
        if "dagster" in n.doors
    ]


def ladder_train_sets(cfg) -> list[Node]:
    """The main ladder's train sets, in rung order (the domain SFT rungs' come with post-training)."""
    return [n for n in data_steps(cfg) if n.wiring == "train_set" and not n.rung.domain]
