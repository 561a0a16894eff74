"""Shared test set-up: offline, quiet, deterministic."""

import os
import subprocess

import pytest

from kiln.databases import connect as db_connect
from kiln.paths import REPO_ROOT

os.environ.setdefault("KILN_PROGRESS", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DAGSTER_DISABLE_TELEMETRY", "1")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models are overhead-bound: a second thread on a shared 2-core runner only adds contention."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def text_encoder_dir(tmp_path_factory):
    """A tiny random BERT text encoder saved to disk, loaded by path like any HF model."""
    from model.testing import write_tiny_text_encoder

    return write_tiny_text_encoder(tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="session")
def krea(tmp_path_factory) -> list[str]:
    """`ladder=krea` with the two folders its model profile (conf/model/krea2_12b.yaml) leaves to the lab, as tiny
    random folders of the classes it promises: a Qwen-Image VAE and a whole Qwen3-VL checkpoint."""
    from test_text_encoder_classes import write_qwen3_vl

    from model.testing import write_tiny_autoencoder_qwenimage

    root = tmp_path_factory.mktemp("krea_models")
    vae = write_tiny_autoencoder_qwenimage(root / "qwen_image_vae")
    (root / "qwen3_vl").mkdir()
    write_qwen3_vl(root / "qwen3_vl")
    return ["ladder=krea", f"model.autoencoder_path={vae}", f"model.text_encoder.path={root / 'qwen3_vl'}"]


@pytest.fixture(scope="session")
def latent_tiny(tmp_path_factory) -> list[str]:
    """`model=latent_tiny` with its two folders: a tiny random AutoencoderKL (4 channels, halving) and BERT."""
    from model.testing import write_tiny_autoencoder_kl, write_tiny_text_encoder

    root = tmp_path_factory.mktemp("latent_tiny")
    vae = write_tiny_autoencoder_kl(root / "vae", latent_channels=4)
    te = write_tiny_text_encoder(root / "text_encoder")
    return ["model=latent_tiny", f"model.autoencoder_path={vae}", f"model.text_encoder.path={te}"]


@pytest.fixture(scope="session")
def prx(tmp_path_factory) -> list[str]:
    """`model=prx_1b` with its two folders as tiny random ones of the promised classes: a FLUX.1-class
    AutoencoderKL and a whole T5Gemma checkpoint."""
    from test_text_encoder_classes import write_t5

    from model.testing import write_tiny_autoencoder_kl

    root = tmp_path_factory.mktemp("prx_models")
    vae = write_tiny_autoencoder_kl(root / "flux1_vae")
    (root / "t5gemma").mkdir()
    write_t5(root / "t5gemma", "t5gemma")
    return ["model=prx_1b", f"model.autoencoder_path={vae}", f"model.text_encoder.path={root / 't5gemma'}"]


@pytest.fixture(scope="session")
def vit_teacher_dir(tmp_path_factory):
    """A tiny random ViT and its image processor saved to disk: a REPA teacher loaded by path like DINOv2."""
    import torch
    from transformers import ViTConfig, ViTImageProcessor, ViTModel

    torch.manual_seed(0)
    cfg = ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    d = tmp_path_factory.mktemp("vit")
    ViTModel(cfg).eval().save_pretrained(str(d))
    ViTImageProcessor(size={"height": 32, "width": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def vlm(tmp_path_factory):
    """A tiny random LLaVA (CLIP vision tower + Llama) saved to disk: the captioner's and labeller's VLM."""
    from caption_fixtures import write_tiny_vlm

    return write_tiny_vlm(tmp_path_factory.mktemp("vlm"))


SLURM_SCRIPT = REPO_ROOT / "scripts" / "slurm-local.sh"


def _sinfo_answers() -> bool:
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def slurm_cluster():
    """SLURM_CONF of a cluster that answers: the one in the environment, else the local one, started, and
    stopped again after the session when this session started it (a running one is left running)."""
    started_here = False
    if not (os.environ.get("SLURM_CONF") and _sinfo_answers()):
        env_line = subprocess.run([str(SLURM_SCRIPT), "env"], capture_output=True, text=True).stdout.strip()
        os.environ["SLURM_CONF"] = env_line.split("=", 1)[1]
        if not _sinfo_answers():
            started = subprocess.run([str(SLURM_SCRIPT), "start"], capture_output=True, text=True, timeout=120)
            started_here = True
            if started.returncode != 0 or not _sinfo_answers():
                why = f"local Slurm did not start: {started.stderr[-2000:]}"
                if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
                    pytest.fail(why)
                pytest.skip(why)
    yield os.environ["SLURM_CONF"]
    if started_here:
        subprocess.run([str(SLURM_SCRIPT), "stop"], capture_output=True, timeout=120)


@pytest.fixture(scope="session")
def dsn():
    """A live Postgres (KILN_PG_DSN, else scripts/postgres-local.sh started, and stopped after the session when
    this session started it); in CI one that cannot start fails."""
    from kiln.warehouse import postgres as pg
    from kiln.warehouse.local import SCRIPT, local_postgres_dsn

    was_running = (
        bool(os.environ.get("KILN_PG_DSN"))
        or subprocess.run([str(SCRIPT), "status"], capture_output=True).returncode == 0
    )
    try:
        dsn = local_postgres_dsn()
        with db_connect(dsn) as conn:
            conn.execute("SELECT 1")
            pg.ensure_registry(conn)
    except Exception as e:  # noqa: BLE001
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"Postgres must run in CI: {e}")
        pytest.skip(f"no Postgres here ({e}); run scripts/postgres-local.sh start")
    yield dsn
    if not was_running:
        subprocess.run([str(SCRIPT), "stop"], capture_output=True, timeout=120)


@pytest.fixture
def mixed_folder(tmp_path):
    """The file zoo of samples.mixed_files written under tmp_path/raw."""
    from samples import mixed_files

    root = tmp_path / "raw"
    for name, (data, _) in mixed_files().items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


@pytest.fixture(scope="session")
def demo_embedded(tmp_path_factory):
    """Built once per test session, whichever module asks first (the stages are deterministic)."""
    from samples import build_demo

    root = tmp_path_factory.getbasetemp() / "curation-demo"
    if (root / "embedded" / "summary.json").is_file():
        return [
            f"data.caption.truth={root / 'raw' / 'truth.parquet'}",
            f"data.clustering.review_db={root / 'review.duckdb'}",
        ], root
    root.mkdir()
    return build_demo(root)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(env: dict[str, str] | None = None):
    """A moto S3-compatible server on a free 127.0.0.1 port: (process, endpoint url), once it answers."""
    import shutil
    import sys
    import time
    import urllib.request

    port = _free_port()
    exe = shutil.which("moto_server") or str(REPO_ROOT / ".venv" / "bin" / "moto_server")
    if not os.path.exists(exe):
        exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(150):
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=1)
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"moto_server did not answer on {url}")


def use_s3_endpoint(url: str) -> None:
    """Point every S3 client of this process at `url` (the standard variables), with fresh s3fs instances."""
    import s3fs

    from kiln.uri import _remote_tar_index

    os.environ.update(
        {
            "AWS_ENDPOINT_URL": url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
    )
    s3fs.S3FileSystem.clear_instance_cache()
    _remote_tar_index.cache_clear()


@pytest.fixture(scope="session")
def s3_server():
    """A local S3-compatible server (moto's server mode) for the whole session; its endpoint url."""
    proc, url = start_moto()
    saved = {
        k: os.environ.get(k)
        for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    }
    use_s3_endpoint(url)
    yield url
    proc.terminate()
    proc.wait(timeout=10)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def s3(s3_server):
    """A boto3 client of the local server, with this process's S3 readers pointed at it."""
    import boto3

    use_s3_endpoint(s3_server)
    return boto3.client("s3", endpoint_url=s3_server)


@pytest.fixture(scope="session")
def defs():
    """The Dagster definitions (an asset per registry node): built once per test process, by the tests that
    need them, not while every worker collects."""
    from dagster_project.definitions import defs

    return defs


@pytest.fixture(scope="session")
def assets_of_nodes():
    """dagster_project.assets.ASSETS: the generated asset of each node, by key."""
    from dagster_project.assets import ASSETS

    return ASSETS
