"""`kiln rubric`: a rubric prompt set from plain prompts, requirements written by an LLM by path
(training.evaluation.rubric)."""

from __future__ import annotations

import json
from pathlib import Path


def add_parser(subparsers):
    a = subparsers.add_parser(
        "rubric",
        help="a rubric prompt set (post.prompts / post.eval_prompts) from plain prompts, requirements written by an LLM by path",
    )
    a.add_argument("--prompts", required=True, help="plain prompts, one a line (blank lines and #-comments skipped)")
    a.add_argument(
        "--llm", required=True, help="a causal LM folder (Hugging Face) that writes each prompt's yes/no questions"
    )
    a.add_argument(
        "--out",
        required=True,
        help="OUT/prompts.jsonl (the set), OUT/rejected.jsonl (prompts it wrote no question for), OUT/rubric.json",
    )
    a.add_argument("--max-new-tokens", type=int, default=96)
    a.add_argument("--device", default="cpu")
    a.add_argument("--overwrite", action="store_true", help="replace an OUT holding files kiln did not write")
    a.set_defaults(fn=rubric_cli)
    return a


def rubric_cli(args) -> int:
    from training.evaluation.rubric import LLMRequirementWriter, write_rubric_set
    from training.evaluation.sampling import read_prompts

    if not 1 <= args.max_new_tokens <= 4096:
        print(f"kiln rubric: --max-new-tokens {args.max_new_tokens} is not in 1..4096")
        return 2
    writer = LLMRequirementWriter(args.llm, args.max_new_tokens, args.device)
    report = write_rubric_set(read_prompts(args.prompts), writer.write, Path(args.out), writer.decoding, args.overwrite)
    print(json.dumps(report, indent=2, sort_keys=True))
    return 0
