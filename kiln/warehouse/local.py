"""The local Postgres of scripts/postgres-local.sh, for tests, benchmarks and a laptop run."""

from __future__ import annotations

import os
import subprocess

from kiln.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "postgres-local.sh"


def local_postgres_dsn(timeout: float = 60.0) -> str:
    """KILN_PG_DSN when set; otherwise start the local server (a no-op when it runs) and return its DSN."""
    if os.environ.get("KILN_PG_DSN"):
        return os.environ["KILN_PG_DSN"]
    done = subprocess.run([str(SCRIPT), "start"], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{SCRIPT} start failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip().splitlines()[-1]
