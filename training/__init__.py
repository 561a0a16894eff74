"""kiln training: everything after the train sets, in subpackages layered bottom-up.

    core/        the loop: trainer, objective, schedules, data streaming, parallelism, checkpoints, PMA
    evaluation/  what a checkpoint is judged by: sampling, held-out loss, prompt following, rubrics, rewards
    post/        post-training from a checkpoint: pairs, reward model, DPO, GRPO, TDM, merging, domain SFT
    expander/    the prompt expander beside the generator: its model, SFT, RL, evaluation
    style/       style references: self-supervised pairs, training, evaluation

Each subpackage imports only those listed above it here (import-linter contracts in pyproject.toml);
`serving` (samples with an expander), `testing` (small real inputs for tests) and `gpu_check` sit on top.
"""
