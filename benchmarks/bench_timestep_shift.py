"""Where the caption is learned, as a function of the timestep shift: the micro DiT trained 250 steps on a red
circle in four places (only the position word tells the captions apart), then, per shift, how far the red's
centroid in its clean-image estimate at t = 1 lands from where the caption puts it.

The finding this measures (docs/training.md): the demo's flat drawings keep their layout visible in x_t up to
t ~ 0.95, so at the latent-space shift (~1 at these token counts) the model learns to denoise from the image and,
for its first thousand steps or so, draws the same mean image whatever the position word; at a high shift it
follows the word within a few hundred. A research finding, not a contract: tests/test_demo_learns_layout.py
guards only that a high shift teaches the position.

    .venv/bin/python benchmarks/bench_timestep_shift.py --shift 0.9 --shift 3 --shift 8

One JSON line per shift: the largest centroid error over the four positions, and whether every one is within 0.08.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> None:
    from components.demo_scenes import POSITION_XY
    from training.testing import (
        POSITIONS,
        follows_the_caption,
        one_shape_in_four_places,
        where_the_shape_goes,
        write_pack_output,
    )

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shift", type=float, action="append", help="timestep shifts to train at (default: 0.9 and 8)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        data = write_pack_output(Path(tmp) / "train_set", one_shape_in_four_places())
        for shift in args.shift or [0.9, 8.0]:
            start = time.perf_counter()
            where = where_the_shape_goes(shift, data, Path(tmp) / f"shift_{shift:g}")
            error = max(float(abs(np.subtract(where[p], POSITION_XY[p])).max()) for p in POSITIONS)
            row = {
                "bench": "timestep_shift",
                "shift": shift,
                "max_centroid_error": round(error, 4),
                "follows_caption": follows_the_caption(where),
            }
            print(json.dumps(row | {"seconds": round(time.perf_counter() - start, 1)}), flush=True)


if __name__ == "__main__":
    main()
