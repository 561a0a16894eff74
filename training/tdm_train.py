"""TDM few-step distillation of a checkpoint into a K-step student sampled without CFG (docs/distillation.md).

Three copies of the teacher: the frozen teacher, the student (trained) and the fake score (trained on the
student's samples). Each iteration draws `batch` prompts and one noise each (pure functions of seed and
iteration), rolls the student's K-step Euler trajectory out without grad, then takes `fake_updates`
fake-score steps and one student step, each on its own draw of stage, times and noise (training/tdm.py
for the losses). The teacher's targets are guided at `teacher_cfg`, so the student bakes the guidance in.

DCP checkpoints (training/dcp.py) hold the student and its optimiser as the model, the fake score and its
optimiser as the Checkpointer's `aux` entry "fake_score", and the iteration, so a killed run resumes to the
same weights as an uninterrupted one. The export is the student (model.safetensors + config.json), the
teacher's train_state.json, and sampler.json with the student's steps, shift and cfg_scale 1, which
`kiln sample` and the evaluation read. One process (CPU or one GPU), like GRPO.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kiln.config import KilnConfig
from kiln.progress import log, progress
from training.data import DataPosition
from training.dcp import Checkpointer, RunState
from training.grpo_train import iteration_seed, rl_prompts
from training.tdm import distribution_matching_loss, effective_noise, fake_score_loss, guided_velocity, importance_weights, renoise, split_velocity, stage_points, step_point

HISTORY = "tdm_history.jsonl"
FAKE = "fake_score"  # the Checkpointer's aux name of the fake score and its optimiser


@dataclass
class Distillation:
    """What one distillation run holds: the three networks, the two optimisers, prompts and geometry."""

    teacher: torch.nn.Module
    student: torch.nn.Module
    fake: torch.nn.Module
    opt: torch.optim.Optimizer
    fake_opt: torch.optim.Optimizer
    prompts: list[str]
    height: int
    width: int
    shift: float
    times: torch.Tensor  # the student's K + 1 Euler times, 1 -> 0


def setup(teacher_ckpt: Path, cfg: KilnConfig) -> Distillation:
    """Teacher (frozen), student and fake score (both from the teacher) with their AdamW optimisers."""
    from model.flow import euler_timesteps
    from model.generator import Generator
    from training.sampling import checkpoint_resolution, sampling_shift

    post, tdm = cfg.post, cfg.post.distill
    device = torch.device(post.device)
    teacher = Generator.from_pretrained(teacher_ckpt, device=device).eval().requires_grad_(False)
    student = Generator.from_pretrained(teacher_ckpt, device=device).train()
    fake = Generator.from_pretrained(teacher_ckpt, device=device).train()
    height, width = (post.resolution, post.resolution) if post.resolution else checkpoint_resolution(Path(teacher_ckpt), cfg)
    shift = sampling_shift(student, height, width, cfg.train)

    def adamw(module, lr):
        return torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.999), weight_decay=tdm.weight_decay)

    prompts = [p.prompt for p in rl_prompts(cfg)]
    times = euler_timesteps(tdm.student_steps, shift).to(device)
    return Distillation(teacher, student, fake, adamw(student, tdm.lr), adamw(fake, tdm.fake_lr), prompts, height, width, shift, times)


def checkpointer(out: Path, d: Distillation) -> Checkpointer:
    return Checkpointer(out, keep=2, async_save=False, mesh_facts={"kind": "tdm"}, aux={FAKE: (d.fake, d.fake_opt)})


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


def draw(states: torch.Tensor, times: torch.Tensor, g: torch.Generator, cfg: KilnConfig) -> Draw:
    tdm = cfg.post.distill
    K, B = states.shape[:2]
    stage = torch.randint(0, K, (B,), generator=g)
    u_mid, u_t = torch.rand(B, generator=g, dtype=torch.float64), torch.rand(B, generator=g, dtype=torch.float64)
    z = torch.randn(states.shape[1:], generator=g).to(states.device)
    pts = stage_points(times.double().cpu(), stage, u_mid, u_t, tdm.t_min, tdm.decoupled, tdm.random_mid)
    x_i = states[stage.to(states.device), torch.arange(B, device=states.device)]
    to = lambda v: v.float().to(states.device)
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


def _step(params, opt, loss: torch.Tensor, clip: float, what: str, it: int) -> float:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
    if not np.isfinite(norm):
        raise FloatingPointError(f"TDM iteration {it}: non-finite {what} gradient norm; lower post.distill learning rates")
    opt.step()
    return norm


def iteration(d: Distillation, it: int, cfg: KilnConfig) -> dict:
    """One iteration: the student's trajectories, `fake_updates` fake-score steps, one student step."""
    tdm = cfg.post.distill
    device = d.times.device
    pick = np.random.default_rng(iteration_seed(tdm.seed, it, "tdm:prompts")).choice(len(d.prompts), size=tdm.batch, replace=tdm.batch > len(d.prompts))
    text = d.student.encode_text([d.prompts[i] for i in pick])
    ae = d.student.autoencoder
    noise = torch.randn(tdm.batch, ae.latent_channels, d.height // ae.downsample, d.width // ae.downsample, generator=torch.Generator().manual_seed(iteration_seed(tdm.seed, it, "tdm:noise"))).to(
        device
    )
    states = student_trajectory(d.student, noise, text, d.times)
    rec = {"fake_loss": 0.0, "importance_weight": 0.0, "fake_grad_norm": 0.0}
    fake_params = [p for p in d.fake.parameters() if p.requires_grad]
    for j in range(tdm.fake_updates):
        dr = draw(states, d.times, torch.Generator().manual_seed(iteration_seed(tdm.seed, it, f"tdm:fake{j}")), cfg)
        with torch.no_grad():
            x0, x_t, n = diffused(d.student, dr, text)
        w = importance_weights(n, dr.z) if tdm.importance_weighting else torch.ones(tdm.batch, device=device)
        loss = fake_score_loss(d.fake(x_t, dr.t, text), x0, n, w)
        rec["fake_grad_norm"] += _step(fake_params, d.fake_opt, loss, tdm.grad_clip, "fake-score", it) / tdm.fake_updates
        rec["fake_loss"] += loss.item() / tdm.fake_updates
        rec["importance_weight"] += float(w.mean()) / tdm.fake_updates
    dr = draw(states, d.times, torch.Generator().manual_seed(iteration_seed(tdm.seed, it, "tdm:student")), cfg)
    x0, x_t, _ = diffused(d.student, dr, text)
    with torch.no_grad():
        v_real = teacher_velocity(d.teacher, x_t, dr.t, text, d.teacher.null_text(tdm.batch), tdm.teacher_cfg)
        v_fake = d.fake(x_t, dr.t, text)
    terms = distribution_matching_loss(x0, x_t, dr.t, v_real, v_fake, tdm.huber_c)
    norm = _step([p for p in d.student.parameters() if p.requires_grad], d.opt, terms.loss, tdm.grad_clip, "student", it)
    return rec | {"student_loss": terms.loss.item(), "teacher_gap": float(terms.teacher_gap.mean()), "student_grad_norm": norm}


def distill(teacher_ckpt: Path, out: Path, cfg: KilnConfig, resume: bool = False, stop_at: int | None = None) -> Path:
    """Distil `teacher_ckpt` into a `post.distill.student_steps`-step student in `out` (model.safetensors,
    config.json, sampler.json, train_state.json, tdm.json, DCP step checkpoints, tdm_history.jsonl).
    `resume`: continue from out's newest DCP checkpoint (without it, a folder holding an earlier run's
    checkpoints is refused: FileExistsError); `stop_at`: end after that iteration (a "kill")."""
    from training.trainer import prepare_output

    tdm, out = cfg.post.distill, Path(out)
    prepare_output(out, resume, overwrite=False)  # a fresh run never replaces an earlier run's checkpoints
    d = setup(Path(teacher_ckpt), cfg)
    ckpt = checkpointer(out, d)
    run = (ckpt.load_latest(d.student, d.opt) if resume else None) or RunState(0, DataPosition())
    out.mkdir(parents=True, exist_ok=True)
    history = start_history(out / HISTORY, run.step if resume else 0)
    end = min(tdm.iterations, stop_at) if stop_at is not None else tdm.iterations
    for it in progress(range(run.step, end), desc="tdm", unit="iter", total=end - run.step):
        t0 = time.perf_counter()
        record = {"iteration": it + 1, **iteration(d, it, cfg), "seconds": round(time.perf_counter() - t0, 3)}
        with history.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        done = it + 1
        if done % tdm.save_every == 0 or done == end:
            ckpt.save(d.student, d.opt, RunState(done, DataPosition()))
        log.info("tdm %d: fake loss %.4f, student loss %.4f, teacher gap %.4f", done, record["fake_loss"], record["student_loss"], record["teacher_gap"])
    ckpt.wait()
    return export(d, Path(teacher_ckpt), out, cfg, end)


def start_history(path: Path, keep_through: int) -> Path:
    """The history file with only the records of iterations <= keep_through (a resume drops the ones after
    the checkpoint it continues from; a fresh run starts empty)."""
    if path.exists():
        kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["iteration"] <= keep_through]
        path.write_text("".join(line + "\n" for line in kept))
    return path


def export(d: Distillation, teacher_ckpt: Path, out: Path, cfg: KilnConfig, iterations: int) -> Path:
    """The student as a checkpoint with its own sampler settings (sampler.json) and provenance (tdm.json)."""
    from training.sampling import SamplerSettings, write_sampler_settings

    tdm = cfg.post.distill
    d.student.save_pretrained(out)
    state = teacher_ckpt / "train_state.json"
    if state.exists():  # the evaluation and sampler read the bucket and config the teacher was trained at
        (out / "train_state.json").write_text(state.read_text())
    write_sampler_settings(out, SamplerSettings(steps=tdm.student_steps, cfg_scale=1.0, shift=d.shift), distilled_from=str(teacher_ckpt), teacher_cfg=tdm.teacher_cfg, method="tdm")
    (out / "tdm.json").write_text(json.dumps({"from": str(teacher_ckpt), "iterations": iterations, "distill": tdm.model_dump(mode="json"), "prompts": len(d.prompts)}, indent=2, sort_keys=True) + "\n")
    return out
