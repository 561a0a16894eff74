"""The registered stage names, importable without pyarrow, torch or the config: `kiln --help`, `kiln stage`,
`kiln map` and `kiln watch` list them and check a name before anything heavy loads."""

from __future__ import annotations

import argparse

# Stage name -> module that defines `STAGE` (kiln.stage.get_stage imports it when the stage runs).
STAGE_MODULES = {
    "ingest": "assets.ingest",
    "filter": "assets.filters",
    "dedup": "assets.dedup",
    "caption": "assets.caption",
    "ocr": "assets.ocr",
    "text_filter": "assets.ocr_filter",
    "caption_ocr": "assets.captioners",
    "rewrite": "assets.rewrite",
    "prompt_pairs": "assets.prompt_pairs",
    "user_prompts": "assets.user_prompts",
    "pack": "assets.pack",
    # curation stage 2, a branch on the dedup output: embed -> classify -> sae -> cluster -> semdedup
    "embed": "assets.embed",
    "classify": "assets.classify",
    "sae": "assets.sae",
    "cluster": "assets.cluster",
    "semdedup": "assets.semdedup",
}


def stage_name(name: str) -> str:
    """argparse `type` for a stage argument: an unknown name is a usage error that lists the stages."""
    if name not in STAGE_MODULES:
        raise argparse.ArgumentTypeError(f"unknown stage {name!r}; stages: {', '.join(STAGE_MODULES)}")
    return name


def add_stage_argument(parser: argparse.ArgumentParser, dest: str = "stage") -> None:
    """The positional STAGE argument, its help naming every stage."""
    parser.add_argument(dest, metavar="STAGE", type=stage_name, help=f"one of: {', '.join(STAGE_MODULES)}")
