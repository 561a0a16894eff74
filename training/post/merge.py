"""Model merging: N checkpoints of one model (e.g. domain SFTs from one base) into one checkpoint.

Per tensor, with sources theta_i, base theta_0, task vectors tau_i = theta_i - theta_0, weights w_i
(`post.merge.weights`; equal 1/N when empty) and lambda = `post.merge.scale`:

    linear           sum_i w_i theta_i / sum_i w_i               model soups (Wortsman et al. 2022, arXiv:2203.05482)
    task_arithmetic  theta_0 + lambda sum_i w_i tau_i            task arithmetic (Ilharco et al. 2023, arXiv:2212.04089)
    ties             theta_0 + lambda disjoint_mean(trim(tau_i)) TIES-Merging (Yadav et al. 2023, arXiv:2306.01708)
    dare             theta_0 + lambda sum_i w_i m_i tau_i / d    DARE (Yu et al. 2024, arXiv:2311.03099)
    dare_ties        theta_0 + lambda disjoint_mean(m_i tau_i / d)

TIES trims each task vector to its round(d * numel) largest magnitudes per tensor (d = `density`; entries
tied with the smallest kept magnitude are kept too), elects each entry's sign as the sign of sum_i w_i tau_i
(the sign with the larger total weighted magnitude; an exact tie elects nothing and keeps the base), and
averages only the entries that agree with it, weighted: sum_{agree} w_i tau_i / sum_{agree} w_i (the paper's
plain mean when the weights are equal). DARE keeps each task-vector entry with probability d (mask m_i) and
rescales the kept ones by 1/d. Its randomness is a pure function of (seed, source position, tensor name,
the entry's flat index in the canonical layout): a counter-based hash in 32-bit integer arithmetic on int64
tensors, so any shard of a tensor draws the very mask the whole tensor would, with no generator state and no
full-size mask made on a rank that holds a shard.

Checkpoints are merged tensor by tensor (`merge_checkpoints`): exports (config.json + model.safetensors,
read with safe_open) or DCP step checkpoints (training/core/dcp.py; a one-tensor dcp.load per read, undoing the
saving run's tp row layout), or a mix. A process holds one tensor per source (and the base) at a time,
and the output is written as it is computed (training/core/safetensors_stream.py). In a torch.distributed job
every rank takes a disjoint set of whole tensors (balanced by bytes), writes them to a part file, and
rank 0 joins the parts into one model.safetensors by byte copy: no rank holds more than one tensor per
source, whatever the model's size, and the result is the same bytes for any number of ranks. The output is
an export folder (config.json, model.safetensors, merge.json, checksums.json) every reader of a
checkpoint loads (Generator.from_pretrained, `train.init_from`, the sampler and the evaluator).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import Tensor

from kiln.config import MergeConfig
from training.core.safetensors_stream import TORCH_DTYPES, SafetensorsWriter, Spec, join_parts, nbytes

METHODS = ("linear", "task_arithmetic", "ties", "dare", "dare_ties")
MERGE_FILE = "merge.json"
SEARCH_FILE = "merge_search.json"
MAX_CANDIDATES = 64


# ----------------------------------------------------------------------------------- per-tensor methods
def resolve_weights(weights: Sequence[float], n: int) -> list[float]:
    """The weights of n sources: as given (one per source, in source order), or 1/n each when empty."""
    if not weights:
        return [1.0 / n] * n
    if len(weights) != n:
        raise ValueError(
            f"post.merge.weights has {len(weights)} entries for {n} sources: give one weight per source, in source order (or none: equal)"
        )
    return [float(w) for w in weights]


def linear(tensors: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """Weighted average sum w_i theta_i / sum w_i (model soups, arXiv:2203.05482)."""
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"linear merge weights {list(weights)} sum to {total}: nothing to average")
    return sum(w * t for w, t in zip(weights, tensors)) / total


def task_arithmetic(base: Tensor, tensors: Sequence[Tensor], weights: Sequence[float], scale: float) -> Tensor:
    """base + scale * sum w_i (theta_i - base) (task arithmetic, arXiv:2212.04089)."""
    return base + scale * sum(w * (t - base) for w, t in zip(weights, tensors))


def trim(delta: Tensor, density: float) -> Tensor:
    """TIES's trim: keep the round(density * numel) entries of largest magnitude (at least one; entries
    tied with the smallest kept magnitude stay too), zero the rest."""
    n = delta.numel()
    if density >= 1 or n == 0:
        return delta
    k = min(n, max(1, int(density * n + 0.5)))
    threshold = delta.abs().reshape(-1).kthvalue(n - k + 1).values  # the k-th largest magnitude
    return torch.where(delta.abs() >= threshold, delta, torch.zeros_like(delta))


def disjoint_mean(deltas: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """TIES's sign election and disjoint merge: per entry, the sign of sum w_i delta_i, then the weighted
    mean of the deltas that have that sign (0 where none does)."""
    elected = torch.sign(sum(w * d for w, d in zip(weights, deltas)))
    num = torch.zeros_like(elected)
    den = torch.zeros_like(elected)
    for w, d in zip(weights, deltas):
        agree = (torch.sign(d) == elected) & (elected != 0)
        num += torch.where(agree, w * d, 0.0)
        den += agree * w
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)


def ties(base: Tensor, tensors: Sequence[Tensor], weights: Sequence[float], density: float, scale: float) -> Tensor:
    """base + scale * disjoint_mean(trim(theta_i - base)) (TIES-Merging, arXiv:2306.01708)."""
    return base + scale * disjoint_mean([trim(t - base, density) for t in tensors], weights)


_M32 = 0xFFFFFFFF
_CHUNK = 1 << 22  # entries hashed at once: bounds the int64 temporaries of a mask


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for 0 <= x < 2**32 on int64 tensors, in 16-bit halves (no product reaches 2**63)."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _M32


def _fmix32(x: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finaliser: a bijection of [0, 2**32) with full avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _keys(seed: int, source: int, name: str) -> tuple[int, int]:
    digest = hashlib.blake2b(f"kiln-dare/{seed}/{source}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


def keep_mask(seed: int, source: int, name: str, index: Tensor, density: float) -> Tensor:
    """DARE's mask at the global flat positions `index` (int64, any shape) of tensor `name` of the
    `source`-th source: True where hash(seed, source, name, position) / 2**32 < density."""
    k0, k1 = _keys(seed, source, name)
    threshold = round(density * 2**32)
    flat = index.reshape(-1).to(torch.int64)
    out = torch.empty(flat.shape, dtype=torch.bool)
    for start in range(0, flat.numel(), _CHUNK):
        i = flat[start : start + _CHUNK]
        out[start : start + _CHUNK] = _fmix32(_fmix32((i & _M32) ^ k0) ^ (i >> 32) ^ k1) < threshold
    return out.view(index.shape)


def block_index(
    shape: Sequence[int], offsets: Sequence[int] | None = None, sizes: Sequence[int] | None = None
) -> Tensor:
    """Global flat (row-major) positions of the block of a `shape` tensor that starts at `offsets` and has
    `sizes` (the whole tensor by default): what a shard passes to `keep_mask` / `dare`."""
    offsets = list(offsets) if offsets is not None else [0] * len(shape)
    sizes = list(sizes) if sizes is not None else list(shape)
    index = torch.zeros((), dtype=torch.int64)
    stride = 1
    for dim in reversed(range(len(shape))):
        axis = (torch.arange(sizes[dim], dtype=torch.int64) + offsets[dim]) * stride
        index = index + axis.view([-1] + [1] * (len(shape) - 1 - dim))
        stride *= shape[dim]
    return index.expand(sizes)


def _full_mask(seed: int, source: int, name: str, shape: torch.Size, density: float) -> Tensor:
    n = math.prod(shape)
    out = torch.empty(n, dtype=torch.bool)
    for start in range(0, n, _CHUNK):
        out[start : start + _CHUNK] = keep_mask(
            seed, source, name, torch.arange(start, min(n, start + _CHUNK)), density
        )
    return out.view(shape)


def dare(
    base: Tensor,
    tensors: Sequence[Tensor],
    weights: Sequence[float],
    density: float,
    scale: float,
    seed: int,
    name: str,
    index: Tensor | None = None,
    elect_sign: bool = False,
) -> Tensor:
    """DARE (arXiv:2311.03099): each task vector's entries kept with probability `density` and rescaled
    by 1/density, then task arithmetic (or, with `elect_sign`, TIES's sign election and disjoint mean:
    dare_ties). `index`: the global flat positions of these entries when they are a shard of `name`."""
    deltas = []
    for i, t in enumerate(tensors):
        keep = (
            _full_mask(seed, i, name, t.shape, density) if index is None else keep_mask(seed, i, name, index, density)
        )
        deltas.append(torch.where(keep, (t - base) / density, 0.0))
    if elect_sign:
        return base + scale * disjoint_mean(deltas, weights)
    return base + scale * sum(w * d for w, d in zip(weights, deltas))


def merge_tensor(name: str, tensors: Sequence[Tensor], base: Tensor | None, cfg: MergeConfig) -> Tensor:
    """One tensor of the merge `cfg` describes, computed in (at least) fp32, in the first source's dtype.
    A non-float tensor (a step counter, an index) must be equal in every source and is kept as it is."""
    first = tensors[0]
    if not first.is_floating_point():
        if any(not torch.equal(t, first) for t in tensors[1:]):
            raise ValueError(f"{name} is a {first.dtype} tensor that differs between the sources: it cannot be merged")
        return first
    weights = resolve_weights(cfg.weights, len(tensors))
    dtype = torch.promote_types(first.dtype, torch.float32)
    xs = [t.to(dtype) for t in tensors]
    if cfg.method == "linear":
        return linear(xs, weights).to(first.dtype)
    if base is None:
        raise ValueError(f"post.merge.method={cfg.method} needs the base checkpoint the sources were trained from")
    b = base.to(dtype)
    if cfg.method == "task_arithmetic":
        out = task_arithmetic(b, xs, weights, cfg.scale)
    elif cfg.method == "ties":
        out = ties(b, xs, weights, cfg.density, cfg.scale)
    elif cfg.method in ("dare", "dare_ties"):
        out = dare(b, xs, weights, cfg.density, cfg.scale, cfg.seed, name, elect_sign=cfg.method == "dare_ties")
    else:
        raise ValueError(f"unknown merge method {cfg.method!r} (one of {', '.join(METHODS)})")
    return out.to(first.dtype)


def merge_state_dicts(
    sources: Sequence[dict[str, Tensor]], base: dict[str, Tensor] | None, cfg: MergeConfig
) -> dict[str, Tensor]:
    """The merge of in-memory state dicts (same names and shapes): small models and tests."""
    for i, s in enumerate(sources[1:], 1):
        if sorted(s) != sorted(sources[0]):
            raise ValueError(f"source {i} has other tensors than source 0: {sorted(set(s) ^ set(sources[0]))[:5]}")
    return {
        name: merge_tensor(name, [s[name] for s in sources], None if base is None else base[name], cfg)
        for name in sorted(sources[0])
    }


# ------------------------------------------------------------------------------------------ checkpoints
class _Export:
    """An export folder (config.json + model.safetensors), read one tensor at a time."""

    kind = "export"

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = path
        self.config = json.loads((path / "config.json").read_text())
        self._file = safe_open(str(path / "model.safetensors"), framework="pt")
        self.specs: dict[str, Spec] = {}
        for name in self._file.keys():  # noqa: SIM118 -- a safe_open handle, not a dict
            piece = self._file.get_slice(name)
            self.specs[name] = (TORCH_DTYPES[piece.get_dtype()], tuple(piece.get_shape()))

    def verify(self, key: bytes, trust_unsigned: bool, rank: int, world: int) -> None:
        from training.core.checkpoint import verify_export

        if rank == 0:
            verify_export(self.path)

    def read(self, name: str) -> Tensor:
        return self._file.get_tensor(name)


class _DcpStep:
    """A DCP step checkpoint (training/core/dcp.py) of a run whose folder has config.json, read one model
    tensor at a time in the canonical layout (the saving run's tp row regrouping undone)."""

    kind = "dcp"

    def __init__(self, path: Path):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from model.dit import DiTConfig
        from training.core.dcp import META
        from training.core.dcp_safe import load_metadata
        from training.core.parallel import fused_layouts

        self.path, self.run = path, path.parent.parent
        if not (self.run / "config.json").exists():
            raise ValueError(
                f"{path} is a DCP step of {self.run}, which has no config.json (the run's export names the model): export the run first"
            )
        self.config = json.loads((self.run / "config.json").read_text())
        meta = load_metadata(path / ".metadata")
        self.specs = {
            k.removeprefix("model."): (v.properties.dtype, tuple(v.size))
            for k, v in meta.state_dict_metadata.items()
            if k.startswith("model.") and isinstance(v, TensorStorageMetadata)
        }
        if not self.specs:
            raise ValueError(f"{path} holds no model weights (no 'model.' entries in its DCP metadata)")
        tp = int(json.loads((path / META).read_text()).get("tp", 1))
        perms = fused_layouts(SimpleNamespace(dit_cfg=DiTConfig(**self.config["dit"])), tp) if tp > 1 else {}
        self._inverse = {}
        for name, perm in perms.items():
            inv = torch.empty_like(perm)
            inv[perm] = torch.arange(len(perm))
            self._inverse[name] = inv

    def verify(self, key: bytes, trust_unsigned: bool, rank: int, world: int) -> None:
        from training.core.checkpoint import verify_export
        from training.core.dcp import verify_step

        verify_step(self.path, key, trust_unsigned, rank, world)  # this rank's share of the step's files
        if rank == 0:
            verify_export(self.run)  # config.json

    def read(self, name: str) -> Tensor:
        from training.core.dcp_safe import safe_load

        dtype, shape = self.specs[name]
        state = {"model": {name: torch.empty(shape, dtype=dtype)}}
        safe_load(state, self.path, no_dist=True)  # only this tensor's chunks are read
        t = state["model"][name]
        return t[self._inverse[name]] if name in self._inverse else t


def open_checkpoint(path: Path) -> _Export | _DcpStep:
    """A reader for a DCP step folder (with .metadata) or an export folder (with model.safetensors)."""
    path = Path(path)
    if (path / ".metadata").exists():
        return _DcpStep(path)
    if (path / "model.safetensors").exists():
        return _Export(path)
    raise ValueError(f"{path} is neither a DCP step checkpoint (.metadata) nor an export (model.safetensors)")


def assign_tensors(specs: dict[str, Spec], world: int) -> list[list[str]]:
    """Disjoint sets of tensor names, one per rank, balanced by bytes (largest first to the lightest
    rank, ties to the lower rank): the same answer on every rank."""
    load = [0] * world
    out: list[list[str]] = [[] for _ in range(world)]
    for name in sorted(specs, key=lambda n: (-nbytes(specs[n]), n)):
        r = min(range(world), key=lambda i: (load[i], i))
        out[r].append(name)
        load[r] += nbytes(specs[name])
    return [sorted(names) for names in out]


def _check_same_model(readers: list, labels: list[str]) -> None:
    first = readers[0]
    for reader, label in zip(readers[1:], labels[1:]):
        if (reader.config["model"], reader.config["dit"]) != (first.config["model"], first.config["dit"]):
            raise ValueError(
                f"{label} {reader.path} is another model than {labels[0]} {first.path}: merging combines checkpoints of one model"
            )
        if sorted(reader.specs) != sorted(first.specs):
            diff = sorted(set(reader.specs) ^ set(first.specs))
            raise ValueError(f"{label} {reader.path} has other tensors than {first.path}: {diff[:5]}")
        for name, (_, shape) in reader.specs.items():
            if shape != first.specs[name][1]:
                raise ValueError(f"{name} is {shape} in {reader.path} but {first.specs[name][1]} in {first.path}")


def _together(fn: Callable, group):
    """fn() on every rank; if it raised on any rank, raise on all (no rank is left in a collective)."""
    error, result = None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 -- re-raised below, after the other ranks know
        error = e
    if group is not None:
        failed = torch.tensor([error is not None], dtype=torch.int64)
        dist.all_reduce(failed, group=group)
        if failed.item() and error is None:
            raise RuntimeError("merge: another rank failed (its error is in its log)")
    if error is not None:
        raise error
    return result


def _merge_my_tensors(
    readers: list, base_reader, names: list[str], specs: dict[str, Spec], path: Path, cfg: MergeConfig, metadata: dict
) -> None:
    writer = SafetensorsWriter(path, {n: specs[n] for n in names}, metadata)
    try:
        for name in names:  # sorted: the writer's order
            tensors = [r.read(name) for r in readers]
            base = base_reader.read(name) if base_reader is not None else None
            writer.write(name, merge_tensor(name, tensors, base, cfg).contiguous())
            del tensors, base
    except BaseException:
        writer.abort()
        raise
    writer.close()


def merge_checkpoints(
    sources: Sequence[Path], base: Path | None, out: Path, cfg: MergeConfig, trust_unsigned: bool = False
) -> Path:
    """Merge `sources` (export folders or DCP step folders, any mix) against `base` (unused by `linear`)
    into the export folder `out`, streaming tensor by tensor. In a torch.distributed job every rank calls
    it and takes its share of the tensors. `trust_unsigned`: read DCP steps another key signed."""
    from model.generator import FORMAT
    from training.core.checkpoint import write_export_manifest
    from training.core.manifest import signing_key

    sources, out = [Path(s) for s in sources], Path(out)
    if not sources:
        raise ValueError("a merge needs at least one source checkpoint")
    weights = resolve_weights(cfg.weights, len(sources))
    uses_base = cfg.method != "linear"
    if uses_base and base is None:
        raise ValueError(f"post.merge.method={cfg.method} needs the base checkpoint the sources were trained from")
    paths = [*sources, Path(base)] if uses_base else sources
    labels = [f"source {i}" for i in range(len(sources))] + (["the base"] if uses_base else [])
    multi = dist.is_initialized() and dist.get_world_size() > 1
    group = dist.new_group(backend="gloo") if multi else None
    rank, world = (dist.get_rank(), dist.get_world_size()) if multi else (0, 1)
    try:
        box = [signing_key() if rank == 0 else None]
        if multi:
            dist.broadcast_object_list(box, src=0, group=group)  # rank 0's key on every node
        readers = _together(lambda: [open_checkpoint(p) for p in paths], group)
        _together(lambda: [r.verify(box[0], trust_unsigned, rank, world) for r in readers], group)
        _together(lambda: _check_same_model(readers, labels), group)
        sources_r, base_r = readers[: len(sources)], (readers[-1] if uses_base else None)
        specs = {name: (dtype, shape) for name, (dtype, shape) in sources_r[0].specs.items()}
        metadata = {"format": FORMAT}
        out.mkdir(parents=True, exist_ok=True)
        mine = assign_tensors(specs, world)[rank]
        part = out / ("model.safetensors" if world == 1 else f".merge-part-rank{rank:05d}.safetensors")
        _together(lambda: _merge_my_tensors(sources_r, base_r, mine, specs, part, cfg, metadata), group)

        def finish() -> None:
            if rank != 0:
                return
            if world > 1:
                parts = [out / f".merge-part-rank{r:05d}.safetensors" for r in range(world)]
                join_parts(parts, out / "model.safetensors", metadata)
                for p in parts:
                    p.unlink()
            (out / "config.json").write_text(json.dumps(sources_r[0].config, indent=2, sort_keys=True) + "\n")
            record = {
                "method": cfg.method,
                "sources": [str(s) for s in sources],
                "kinds": [r.kind for r in sources_r],
                "base": str(base) if uses_base else None,
                "weights": weights,
                "density": cfg.density if cfg.method in ("ties", "dare", "dare_ties") else None,
                "scale": cfg.scale if uses_base else None,
                "seed": cfg.seed if cfg.method in ("dare", "dare_ties") else None,
                "ranks": world,
            }
            (out / MERGE_FILE).write_text(json.dumps(record, indent=2) + "\n")
            write_export_manifest(out)

        _together(finish, group)
    finally:
        if group is not None:
            dist.destroy_process_group(group)
    return out


def merge_exports(sources: Sequence[Path], base: Path | None, out: Path, cfg: MergeConfig) -> Path:
    """Merge export folders (config.json + model.safetensors, as Generator.save_pretrained writes) into
    the export folder `out`: each source's checksums verified, one tensor per source in memory at a time."""
    for p in [*sources, *([base] if base is not None else [])]:
        if not (Path(p) / "model.safetensors").exists():
            raise ValueError(
                f"{p} is not an export folder (no model.safetensors): merge_dcp reads DCP step checkpoints"
            )
    return merge_checkpoints(sources, base, out, cfg)


def merge_dcp(
    sources: Sequence[Path], base: Path | None, out: Path, cfg: MergeConfig, trust_unsigned: bool = False
) -> Path:
    """Merge DCP step checkpoints (`<run>/dcp/step-NNNNNN`, signed by this user's key unless
    `trust_unsigned`; the base may also be an export) into the export folder `out`, without gathering the
    model anywhere: one tensor per source at a time, and under torch.distributed each rank merges its own
    disjoint share of the tensors (call it on every rank)."""
    for p in sources:
        if not (Path(p) / ".metadata").exists():
            raise ValueError(f"{p} is not a DCP step checkpoint (no .metadata): merge_exports reads export folders")
    return merge_checkpoints(sources, base, out, cfg, trust_unsigned)


# ---------------------------------------------------------------------------------------------- search
def simplex_grid(n: int, grid: int) -> list[list[float]]:
    """Every weight vector of n entries k_i / grid (k_i >= 0) summing to 1, the first weight largest first."""

    def parts(n: int, total: int):
        if n == 1:
            yield (total,)
            return
        for k in range(total, -1, -1):
            for rest in parts(n - 1, total - k):
                yield (k, *rest)

    return [[k / grid for k in p] for p in parts(n, grid)]


def search_candidates(cfg: MergeConfig, n: int) -> list[MergeConfig]:
    """The merges `merge_search` tries, in order: each of `cfg.search` over `cfg`, then the weight grid;
    `cfg` alone when both are empty. Every candidate's weights are checked against the n sources."""
    plain = cfg.model_copy(update={"search": [], "grid": 0})
    out = [
        plain.model_copy(update={k: v for k, v in c.model_dump().items() if v is not None and v != []})
        for c in cfg.search
    ]
    if cfg.grid:
        count = math.comb(cfg.grid + n - 1, n - 1)
        if len(out) + count > MAX_CANDIDATES:
            raise ValueError(
                f"post.merge.grid={cfg.grid} over {n} sources is {count} weight vectors (+{len(out)} listed): the search tries at most {MAX_CANDIDATES}"
            )
        out += [plain.model_copy(update={"weights": w}) for w in simplex_grid(n, cfg.grid)]
    out = out or [plain]
    for i, c in enumerate(out):
        try:
            resolve_weights(c.weights, n)
        except ValueError as e:
            raise ValueError(f"merge search candidate {i}: {e}") from None
    return out


def merge_search(
    sources: Sequence[Path],
    base: Path | None,
    out: Path,
    cfg: MergeConfig,
    score: Callable[[Path], dict[str, float]],
    trust_unsigned: bool = False,
) -> dict:
    """Try each of `search_candidates(cfg)`, score each merged checkpoint folder with `score` (per-domain
    scores, higher is better: the caller's evaluation protocol), keep the best by the mean of its scores
    (ties: the first; a non-finite mean is never kept) in `out`, and write `out/merge_search.json` listing
    every candidate with its scores and which was kept. Returns that report.

    Candidates are merged into `<out's parent>/.<out name>.merge-search/` and only the best so far is kept
    on disk; that scratch folder is removed at the end, whatever happens."""
    sources, out = [Path(s) for s in sources], Path(out)
    candidates = search_candidates(cfg, len(sources))
    scratch = out.parent / f".{out.name}.merge-search"
    shutil.rmtree(scratch, ignore_errors=True)  # this function's own leftover from a killed search
    rows: list[dict] = []
    best: int | None = None
    try:
        for i, c in enumerate(candidates):
            folder = scratch / f"candidate-{i:03d}"
            merge_checkpoints(sources, base, folder, c, trust_unsigned)
            scores = {str(k): float(v) for k, v in score(folder).items()}
            if not scores:
                raise ValueError(
                    f"the score of merge candidate {i} ({folder}) is empty: it must score at least one domain"
                )
            mean = sum(scores.values()) / len(scores)
            rows.append(
                {
                    "candidate": i,
                    "method": c.method,
                    "weights": resolve_weights(c.weights, len(sources)),
                    "scale": c.scale,
                    "density": c.density,
                    "scores": scores,
                    "mean": mean if math.isfinite(mean) else None,
                }
            )
            if math.isfinite(mean) and (best is None or mean > rows[best]["mean"]):
                if best is not None:
                    shutil.rmtree(scratch / f"candidate-{best:03d}")
                best = i
            else:
                shutil.rmtree(folder)
        report = {
            "sources": [str(s) for s in sources],
            "base": None if base is None else str(base),
            "kept": best,
            "rule": "the highest mean of the per-domain scores; ties: the first",
            "candidates": rows,
        }
        out.mkdir(parents=True, exist_ok=True)
        if best is None:
            (out / SEARCH_FILE).write_text(json.dumps(report, indent=2) + "\n")
            raise ValueError(f"no merge candidate has a finite mean score: nothing kept (see {out / SEARCH_FILE})")
        kept = scratch / f"candidate-{best:03d}"
        for f in sorted(kept.iterdir()):
            os.replace(f, out / f.name)
        (out / SEARCH_FILE).write_text(json.dumps(report, indent=2) + "\n")
        return report
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
