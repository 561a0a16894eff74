"""kiln: raw images in, an evaluated text-to-image DiT out, every artifact in between a versioned asset."""

from kiln import numerics as _numerics

_numerics.apply()  # before anything imports numpy: the caps are read when it loads (kiln/numerics.py)

__version__ = "0.1.0"
