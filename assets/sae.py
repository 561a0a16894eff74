"""The sae stage: EMBEDDED -> EMBEDDED; a top-k sparse autoencoder tags rows, configured tags filter them.

A top-k SAE (Gao et al. 2024) re-expresses each embedding as a sparse sum of `k` of `features`
learned directions: z = TopK(ReLU(W_enc (x - b_dec) + b_enc)), x_hat = W_dec z + b_dec, trained on
the mean squared reconstruction error with unit-norm decoder columns. Each feature is described by
its top-activating images and tagged by a namer reading them (captions for the demo, as for
clusters), so that a person can say "drop what feature 12 fires on" or "drop every 'watermark'
feature". Rows on which a feature listed in `reject_features`, or tagged with a word in
`reject_tags`, is active are rejected with `sae_tag` (value: the activation, detail: feature:tag).
With neither list set the stage passes every row through without training.

Training is seeded and full-batch on the rows given, so the same rows train the same SAE. Weights
are saved and loaded as safetensors (`save_sae` / `load_sae`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from assets.embed import matrix
from kiln.config import KilnConfig, SAEConfig
from kiln.reasons import Reason
from kiln.schemas import EMBEDDED
from kiln.stage import Rejects, Stage, StageOutput


class TopKSAE(nn.Module):
    def __init__(self, dim: int, features: int, k: int):
        super().__init__()
        self.k = k
        self.b_dec = nn.Parameter(torch.zeros(dim))
        self.enc = nn.Linear(dim, features)
        self.dec = nn.Linear(features, dim, bias=False)
        with torch.no_grad():  # tied initialisation, as in Gao et al.
            self.dec.weight.copy_(self.enc.weight.T / self.enc.weight.T.norm(dim=0, keepdim=True))
            self.enc.bias.zero_()

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        pre = torch.relu(self.enc(x - self.b_dec))
        vals, idx = pre.topk(min(self.k, pre.shape[-1]), dim=-1)
        return torch.zeros_like(pre).scatter(-1, idx, vals)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.encode(x)
        return self.dec(z) + self.b_dec, z

    @torch.no_grad()
    def normalise_decoder(self) -> None:
        self.dec.weight /= self.dec.weight.norm(dim=0, keepdim=True).clamp_min(1e-8)


def train_sae(x: np.ndarray, cfg: SAEConfig) -> tuple[TopKSAE, list[float]]:
    """Full-batch Adam on the reconstruction MSE; returns the SAE and the loss of every step."""
    torch.manual_seed(cfg.seed)
    xt = torch.as_tensor(x, dtype=torch.float32)
    sae = TopKSAE(xt.shape[1], cfg.features, cfg.k)
    with torch.no_grad():
        sae.b_dec.copy_(xt.mean(0))  # start the decoder bias at the data mean
    opt = torch.optim.Adam(sae.parameters(), lr=cfg.lr)
    losses = []
    for _ in range(cfg.steps):
        x_hat, _ = sae(xt)
        loss = (x_hat - xt).pow(2).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sae.normalise_decoder()
        losses.append(float(loss.detach()))
    return sae.eval(), losses


def save_sae(sae: TopKSAE, path: Path | str) -> None:
    from safetensors.torch import save_file

    meta = {"k": str(sae.k), "dim": str(sae.enc.in_features), "features": str(sae.enc.out_features)}
    save_file({k: v.contiguous() for k, v in sae.state_dict().items()}, str(path), metadata=meta)


def load_sae(path: Path | str) -> TopKSAE:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    sae = TopKSAE(int(meta["dim"]), int(meta["features"]), int(meta["k"]))
    sae.load_state_dict(load_file(str(path)))
    return sae.eval()


@torch.no_grad()
def activations(sae: TopKSAE, x: np.ndarray) -> np.ndarray:
    return sae.encode(torch.as_tensor(x, dtype=torch.float32)).numpy()


# ----------------------------------------------------------------------------------------- features
@dataclass(frozen=True)
class Feature:
    index: int
    frequency: float  # share of rows on which it is active
    top_ids: list[str]  # top-activating rows, strongest first
    tag: str  # what the namer reads in them; "dead" if it never fires


def describe_features(table: pa.Table, z: np.ndarray, top_n: int, namer=None) -> list[Feature]:
    """Each feature by its top-activating rows, tagged by a namer (assets.cluster.Namer) when given."""
    ids = table.column("id").to_pylist()
    out = []
    for f in range(z.shape[1]):
        active = np.flatnonzero(z[:, f] > 0)
        if not len(active):
            out.append(Feature(f, 0.0, [], "dead"))
            continue
        top = active[np.lexsort((np.array([ids[i] for i in active]), -z[active, f]))][:top_n]
        tag = namer.name_cluster(table.take(pa.array(top))) if namer is not None else f"feature {f}"
        out.append(Feature(f, len(active) / len(ids), [ids[i] for i in top], tag))
    return out


def rejected_features(features: list[Feature], cfg: SAEConfig) -> dict[int, str]:
    """feature -> tag for features named in reject_features or whose tag contains a reject_tags word."""
    words = {t.lower() for t in cfg.reject_tags}
    return {f.index: f.tag for f in features if f.index in cfg.reject_features or words & set(f.tag.lower().split())}


# ------------------------------------------------------------------------------------------- stage
def sae_rows(table: pa.Table, cfg: KilnConfig, namer=None, stage: str = "sae") -> tuple[StageOutput, list[Feature]]:
    s = cfg.data.sae
    rejects = Rejects(stage)
    if table.num_rows == 0 or not (s.reject_tags or s.reject_features):
        return StageOutput(table, rejects.table()), []
    x = matrix(table)
    sae, _ = train_sae(x, s)
    z = activations(sae, x)
    if namer is None and s.reject_tags:
        from assets.cluster import make_namer

        namer = make_namer(cfg)
    features = describe_features(table, z, s.top_n, namer)
    bad = rejected_features(features, s)
    ids, uris = table.column("id").to_pylist(), table.column("uri").to_pylist()
    keep = []
    for r in range(table.num_rows):
        hit = [f for f in sorted(bad) if z[r, f] > 0]
        if hit:
            f = max(hit, key=lambda f: (z[r, f], -f))
            rejects.add(ids[r], uris[r], Reason.SAE_TAG, float(z[r, f]), f"{f}:{bad[f]}")
        else:
            keep.append(r)
    return StageOutput(table.take(pa.array(keep, pa.int64())), rejects.table()), features


def sae_stage(table: pa.Table, cfg: KilnConfig) -> StageOutput:
    return sae_rows(table, cfg)[0]


STAGE = Stage("sae", sae_stage, input_schema=EMBEDDED, output_schema=EMBEDDED, scope="global")
