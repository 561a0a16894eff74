"""A value computed again in a new Python process, with another hash seed: equal to this process's value, it is a
pure function of its inputs (not of `hash()`, set order, a global RNG or state left by an earlier call)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def in_fresh_process(code: str, hash_seed: str = "4242") -> object:
    """The JSON the snippet's last line prints, run by this interpreter in a new process."""
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_until_killed(code: str, *args: str) -> None:
    """Run the snippet with `args` in a new process from the repo root; it must end by SIGKILL (a pre-emption
    or a power cut in the middle of a run), and its stderr says why when it does not."""
    import signal
    from pathlib import Path

    child = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=600
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
