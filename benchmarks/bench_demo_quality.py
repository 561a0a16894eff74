"""What each lever buys the demo model: held-out prompt following per variant, within the demo's budget.

A variant is a name and Hydra overrides (train.*, model.*, data.rewrite.form_probs, ...). Each is trained
with the real trainer on one packed set and scored with one protocol: the 12 demo prompts plus 36 grammar
prompts none of which is one of them (training.evaluation.rubric.demo_rl_prompts, a seed apart from the evaluation's),
`--n` images each on a noise seed no evaluation uses, judged by the demo's pixel checker. The table gives
every attribute, "all attributes right", the training steps and the training seconds, so a lever that buys
quality by spending more time than the budget shows it. Sampler settings (steps, CFG, inference shift)
are levers too: `--sampler` scores each checkpoint again under each setting without retraining.

    .venv/bin/python benchmarks/bench_demo_quality.py --data data/train_set_pretrain \\
        --variant base= --variant long_captions=data.rewrite.form_probs={long:1.0} \\
        --sampler 10,3.0 --sampler 25,3.0 --sampler 25,5.0
    .venv/bin/python benchmarks/bench_demo_quality.py --checkpoint base=data/checkpoint_pretrain

The report is Markdown on stdout plus one JSON line per (variant, sampler) row.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

HELD_OUT_PROMPTS = 36
PROMPT_SEED = 777  # the held-out prompt draw (the evaluation and RL use other seeds)
NOISE_SEED = 99  # the images' noise (the evaluation uses train.eval.seed)
ATTRIBUTES = ("background", "color", "position", "count", "shape", "all")


def score_checkpoint(
    checkpoint: Path, overrides: list[str], n: int, steps: int, cfg_scale: float, shift: float | None
) -> dict:
    """Prompt following of `checkpoint` on the demo and held-out prompts, as {set: {attribute: accuracy}}."""
    import torch

    from kiln.config import TrainConfig, load_config
    from model.generator import Generator
    from training.core.checkpoint import read_train_state
    from training.evaluation.evaluate import eval_rubric
    from training.evaluation.rubric import demo_rl_prompts, rubric_scores
    from training.evaluation.sampling import checkpoint_resolution, generate, sampling_shift

    cfg = load_config(overrides)
    torch.set_num_threads(cfg.train.threads or torch.get_num_threads())
    gen = Generator.from_pretrained(checkpoint)
    h, w = checkpoint_resolution(checkpoint, cfg)
    demo, judge = eval_rubric(cfg)
    trained = TrainConfig.model_validate(read_train_state(checkpoint).config["train"])  # the shift it was trained with
    shift = shift or sampling_shift(gen, h, w, trained)
    out = {"shift": round(shift, 3)}
    for name, prompts in (("demo", demo), ("held_out", demo_rl_prompts(HELD_OUT_PROMPTS, seed=PROMPT_SEED))):
        images = generate(gen, [p.prompt for p in prompts], n, h, w, steps, cfg_scale, NOISE_SEED, shift)
        out[name] = {k: round(v, 3) for k, v in rubric_scores(judge, prompts, images)[1].items()}
    return out


def train_variant(data: Path, out: Path, overrides: list[str]) -> float:
    from kiln.config import load_config
    from training.core.trainer import train

    started = time.perf_counter()
    train(data, out, load_config(overrides), overwrite=True)
    return time.perf_counter() - started


def _variant(text: str) -> tuple[str, list[str]]:
    name, _, rest = text.partition("=")
    return name, [o for o in rest.split(" ") if o]


def _sampler(text: str) -> tuple[int, float, float | None]:
    parts = text.split(",")
    return int(parts[0]), float(parts[1]), float(parts[2]) if len(parts) > 2 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, help="a pack output to train the variants on")
    ap.add_argument(
        "--variant", action="append", default=[], type=_variant, help="NAME=override override ... (space-separated)"
    )
    ap.add_argument(
        "--checkpoint", action="append", default=[], help="NAME=FOLDER: score a trained checkpoint as a variant"
    )
    ap.add_argument(
        "--sampler",
        action="append",
        default=[],
        type=_sampler,
        help="STEPS,CFG[,SHIFT]; default: train.eval.steps and train.sample.cfg_scale",
    )
    ap.add_argument("--n", type=int, default=6, help="images per prompt")
    ap.add_argument("--out", type=Path, default=Path("data/bench_demo_quality"))
    ap.add_argument("overrides", nargs="*", help="overrides shared by every variant (e.g. train.threads=1)")
    args = ap.parse_args()

    from kiln.config import load_config

    base = load_config(args.overrides)
    samplers = args.sampler or [(base.train.eval.steps, base.train.sample.cfg_scale, None)]
    runs: list[tuple[str, Path, float | None, list[str]]] = []
    for name, extra in args.variant:
        if args.data is None:
            ap.error("--variant needs --data")
        folder = args.out / name
        seconds = train_variant(args.data, folder, args.overrides + extra)
        runs.append((name, folder, seconds, args.overrides + extra))
    for item in args.checkpoint:
        name, _, folder = item.partition("=")
        runs.append((name, Path(folder), None, args.overrides))

    print(
        "| variant | steps | train s | sampler | " + " | ".join(f"held-out {a}" for a in ATTRIBUTES) + " | demo all |"
    )
    print("|---|---|---|---|" + "---|" * (len(ATTRIBUTES) + 1))
    for name, folder, seconds, overrides in runs:
        steps_trained = json.loads((folder / "train_state.json").read_text()).get("step")
        for steps, cfg_scale, shift in samplers:
            r = score_checkpoint(folder, overrides, args.n, steps, cfg_scale, shift)
            held = r["held_out"]
            sampler = f"{steps} steps, cfg {cfg_scale:g}, shift {r['shift']:g}"
            train_s = "-" if seconds is None else f"{seconds:.0f}"
            print(
                f"| {name} | {steps_trained} | {train_s} | {sampler} | "
                + " | ".join(f"{held.get(a, float('nan')):.2f}" for a in ATTRIBUTES)
                + f" | {r['demo']['all']:.2f} |",
                flush=True,
            )
            print(
                json.dumps(
                    {
                        "variant": name,
                        "overrides": overrides,
                        "train_steps": steps_trained,
                        "train_s": seconds,
                        "steps": steps,
                        "cfg": cfg_scale,
                        **r,
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
