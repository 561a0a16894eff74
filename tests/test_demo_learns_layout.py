"""Where the caption is learned: only at timesteps where the image no longer shows the layout.

The demo's flat-colour drawings keep their layout visible in x_t up to t ~ 0.95. Trained at a high shift, the
micro model puts the shape where the caption says within a few hundred steps (the diagnosis, and what the
latent-space shift does instead: docs/training.md and benchmarks/bench_timestep_shift.py). This guards the
timestep shift reaching the trainer's draws and the text path carrying a spatial word.
"""

from __future__ import annotations

import pytest

from training.testing import follows_the_caption, one_shape_in_four_places, where_the_shape_goes, write_pack_output


@pytest.mark.slow
def test_a_high_shift_teaches_where_the_caption_puts_the_shape(tmp_path):
    data = write_pack_output(tmp_path / "train_set", one_shape_in_four_places())
    high = where_the_shape_goes(8.0, data, tmp_path / "high")
    assert follows_the_caption(high), high
