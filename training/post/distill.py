"""TDM few-step distillation of a checkpoint into a K-step student sampled without CFG (docs/distillation.md).

Three copies of the teacher: the frozen teacher, the student (trained) and the fake score (trained on the
student's samples). Each iteration draws `batch` prompts and one noise each (pure functions of seed and
iteration), rolls the student's K-step Euler trajectory out without grad, then takes `fake_updates`
fake-score steps and one student step, each on its own draw of stage, times and noise (training/post/tdm.py
for the losses). The teacher's targets are guided at `teacher_cfg`, so the student bakes the guidance in.

Runs in one process or under torchrun / a Slurm job with FSDP2 (+ TP) like `kiln train`, on the shared
post-training runner (training/post/runner.py): the student is the run's policy, the fake score its
`trained` copy "fake_score" (with its own optimiser, saved as the Checkpointer's `aux`), the teacher a
frozen copy. Every draw is made for the whole batch and each data-parallel rank keeps its contiguous rows,
scaling its losses by its share of the batch, so N ranks compute what one process does (to float
rounding), and the logged terms are global means. DCP checkpoints hold both networks, both optimisers and
the iteration, so a killed run resumes to the same weights as an uninterrupted one. The export is the
student (model.safetensors + config.json), the teacher's train_state.json, and sampler.json with the
student's steps, shift and cfg_scale 1, which `kiln sample` and the evaluation read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kiln.config import KilnConfig
from kiln.progress import log, progress
from training.post.grpo import rl_prompts
from training.post.runner import PostRun, iteration_seed, last_step, open_run
from training.post.tdm import (
    distribution_matching_loss,
    effective_noise,
    fake_score_loss,
    guided_velocity,
    importance_weights,
    renoise,
    split_velocity,
    stage_points,
    step_point,
)

HISTORY = "tdm_history.jsonl"
FAKE = "fake_score"  # the Checkpointer's aux name of the fake score and its optimiser


@dataclass
class Distillation:
    """What one distillation run holds: the run (the student is its policy, with its optimiser, ranks and
    checkpointer), the frozen teacher, the fake score and its optimiser, prompts, geometry, this rank's rows."""

    run: PostRun
    teacher: torch.nn.Module
    fake: torch.nn.Module
    fake_opt: torch.optim.Optimizer
    prompts: list[str]
    height: int
    width: int
    shift: float
    times: torch.Tensor  # the student's K + 1 Euler times, 1 -> 0
    mine: slice  # this data-parallel rank's rows of each iteration's `batch`

    @property
    def student(self) -> torch.nn.Module:
        return self.run.policy


@torch.no_grad()
def student_trajectory(student, noise: torch.Tensor, text, times: torch.Tensor) -> torch.Tensor:
    """[K, B, ...]: the states the student's Euler sampler visits at times[0..K-1] (times[0] = 1: the noise)."""
    x, states = noise, []
    for i in range(len(times) - 1):
        states.append(x)
        x = x + (times[i + 1] - times[i]) * student(x, times[i].expand(x.shape[0]), text)
    return torch.stack(states)


@dataclass
class Draw:
    """One TDM draw per trajectory: the stage's state and the times (training/tdm.stage_points) and noise."""

    x_i: torch.Tensor
    t_i: torch.Tensor
    s: torch.Tensor
    t: torch.Tensor
    z: torch.Tensor


def draw(states: torch.Tensor, times: torch.Tensor, g: torch.Generator, cfg: KilnConfig, mine: slice) -> Draw:
    """Stages, times and noise drawn for the whole batch (`post.distill.batch`, so any number of ranks draws
    what one process does); this rank's rows (`mine`) are kept, `states` holding only those."""
    tdm = cfg.post.distill
    K, B, device = states.shape[0], tdm.batch, states.device
    stage = torch.randint(0, K, (B,), generator=g)
    u_mid, u_t = torch.rand(B, generator=g, dtype=torch.float64), torch.rand(B, generator=g, dtype=torch.float64)
    z = torch.randn((B, *states.shape[2:]), generator=g)[mine].to(device)
    pts = stage_points(times.double().cpu(), stage, u_mid, u_t, tdm.t_min, tdm.decoupled, tdm.random_mid)
    local = stage[mine].to(device)
    x_i = states[local, torch.arange(len(local), device=device)]
    to = lambda v: v[mine].float().to(device)
    return Draw(x_i, to(pts.t_i), to(pts.s), to(pts.t), z)


def diffused(student, dr: Draw, text) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The student's clean prediction at its stage state (with grad if enabled), the point of its step at s
    diffused to t (detached), and that point's effective noise (detached)."""
    x0, eps = split_velocity(dr.x_i, student(dr.x_i, dr.t_i, text), dr.t_i)
    x_s = step_point(x0, eps, dr.s).detach()
    return x0, renoise(x_s, dr.s, dr.t, dr.z), effective_noise(eps.detach(), dr.s, dr.t, dr.z)


def teacher_velocity(teacher, x_t: torch.Tensor, t: torch.Tensor, text, null, scale: float) -> torch.Tensor:
    """The teacher's velocity at (x_t, t), guided at `scale` (one forward over [cond; uncond], as the sampler)."""
    from model.text_encoder import TextBatch

    if scale == 1.0:
        return teacher(x_t, t, text)
    v_cond, v_uncond = teacher(torch.cat([x_t, x_t]), torch.cat([t, t]), TextBatch.cat([text, null])).chunk(2)
    return guided_velocity(v_cond, v_uncond, scale)


def _step(run: PostRun, module, opt, loss: torch.Tensor, clip: float, what: str, it: int) -> float:
    """One optimiser step of `module` on this rank's (share-scaled) loss; the global gradient norm."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    norm = run.clip_grads(clip, module)
    if not np.isfinite(norm):
        raise FloatingPointError(
            f"TDM iteration {it}: non-finite {what} gradient norm; lower post.distill learning rates"
        )
    opt.step()
    return norm


def iteration(d: Distillation, it: int, cfg: KilnConfig) -> dict:
    """One iteration: the student's trajectories, `fake_updates` fake-score steps, one student step. Each
    rank's loss (a mean over its rows) is scaled by its share of the batch, so FSDP's gradient average over
    the data-parallel ranks is the gradient of the global mean; the logged terms are global means."""
    tdm, run, student, mine = cfg.post.distill, d.run, d.student, d.mine
    B, n, device = tdm.batch, d.mine.stop - d.mine.start, run.device
    share = run.share(mine, B)
    pick = np.random.default_rng(iteration_seed(tdm.seed, it, "tdm:prompts")).choice(
        len(d.prompts), size=B, replace=B > len(d.prompts)
    )
    text = student.encode_text([d.prompts[i] for i in pick[mine]])
    ae = student.autoencoder
    shape = (B, ae.latent_channels, d.height // ae.downsample, d.width // ae.downsample)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(iteration_seed(tdm.seed, it, "tdm:noise")))[
        mine
    ].to(device)
    states = student_trajectory(student, noise, text, d.times)
    fake_loss = weight_sum = fake_norm = 0.0  # sums over this rank's rows (the norm is global already)
    for j in range(tdm.fake_updates):
        dr = draw(
            states, d.times, torch.Generator().manual_seed(iteration_seed(tdm.seed, it, f"tdm:fake{j}")), cfg, mine
        )
        with torch.no_grad():
            x0, x_t, eff = diffused(student, dr, text)
        w = importance_weights(eff, dr.z) if tdm.importance_weighting else torch.ones(n, device=device)
        loss = fake_score_loss(d.fake(x_t, dr.t, text), x0, eff, w)
        fake_norm += _step(run, d.fake, d.fake_opt, loss * share, tdm.grad_clip, "fake-score", it) / tdm.fake_updates
        fake_loss += loss.item() * n / tdm.fake_updates
        weight_sum += float(w.sum()) / tdm.fake_updates
    dr = draw(states, d.times, torch.Generator().manual_seed(iteration_seed(tdm.seed, it, "tdm:student")), cfg, mine)
    x0, x_t, _ = diffused(student, dr, text)
    with torch.no_grad():
        v_real = teacher_velocity(d.teacher, x_t, dr.t, text, d.teacher.null_text(n), tdm.teacher_cfg)
        v_fake = d.fake(x_t, dr.t, text)
    terms = distribution_matching_loss(x0, x_t, dr.t, v_real, v_fake, tdm.huber_c)
    norm = _step(run, student, run.opt, terms.loss * share, tdm.grad_clip, "student", it)
    sums = run.all_sum([fake_loss, weight_sum, terms.loss.item() * n, terms.teacher_gap.sum()])
    fake_loss, weight, student_loss, gap = (v / B for v in sums)
    return {
        "fake_loss": fake_loss,
        "importance_weight": weight,
        "fake_grad_norm": fake_norm,
        "student_loss": student_loss,
        "teacher_gap": gap,
        "student_grad_norm": norm,
    }


def distill(
    teacher_ckpt: Path,
    out: Path,
    cfg: KilnConfig,
    resume: bool = False,
    stop_at: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Distil `teacher_ckpt` into a `post.distill.student_steps`-step student in `out` (model.safetensors,
    config.json, sampler.json, train_state.json, tdm.json, DCP step checkpoints, tdm_history.jsonl).
    `resume`: continue from out's newest DCP checkpoint (without it, a folder holding an earlier run's
    checkpoints is refused: FileExistsError, unless `overwrite`); `stop_at`: end after that iteration (a "kill")."""
    from model.flow import euler_timesteps
    from training.evaluation.sampling import (
        SamplerSettings,
        checkpoint_resolution,
        sampling_shift,
        write_sampler_settings,
    )

    post, tdm, out, teacher_ckpt = cfg.post, cfg.post.distill, Path(out), Path(teacher_ckpt)
    prompts = [p.prompt for p in rl_prompts(cfg)]
    with open_run(
        "tdm",
        teacher_ckpt,
        out,
        cfg,
        resume,
        tdm.lr,
        "iteration",
        weight_decay=tdm.weight_decay,
        trained={FAKE: tdm.fake_lr},
        overwrite=overwrite,
    ) as run:
        mine = run.rows(tdm.batch, "post.distill.batch")
        fake, fake_opt = run.trained[FAKE]
        height, width = (
            (post.resolution, post.resolution) if post.resolution else checkpoint_resolution(teacher_ckpt, cfg)
        )
        shift = sampling_shift(run.policy, height, width, cfg.train)
        times = euler_timesteps(tdm.student_steps, shift).to(run.device)
        d = Distillation(run, run.frozen(teacher_ckpt), fake, fake_opt, prompts, height, width, shift, times, mine)
        run.policy.train(), fake.train()
        end = last_step(tdm.iterations, stop_at)
        for it in progress(range(run.start, end), desc="tdm", unit="iter", total=end - run.start):
            record = {
                "iteration": it + 1,
                **iteration(d, it, cfg),
            }  # no wall-clock: the history is part of the pinned output
            done = it + 1
            run.step_done(record, done, tdm.save_every, end)
            if run.ranks.rank == 0:
                log.info(
                    "tdm %d: fake loss %.4f, student loss %.4f, teacher gap %.4f",
                    done,
                    record["fake_loss"],
                    record["student_loss"],
                    record["teacher_gap"],
                )
        if run.ranks.rank == 0:  # before the export, whose checksums mark the folder complete
            out.mkdir(parents=True, exist_ok=True)
            write_sampler_settings(
                out,
                SamplerSettings(steps=tdm.student_steps, cfg_scale=1.0, shift=shift),
                distilled_from=str(teacher_ckpt),
                teacher_cfg=tdm.teacher_cfg,
                method="tdm",
            )
        record = {
            "from": str(teacher_ckpt),
            "iterations": end,
            "distill": tdm.model_dump(mode="json"),
            "prompts": len(prompts),
        }
        return run.export(teacher_ckpt, record)
