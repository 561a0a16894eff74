"""kiln: raw images in, an evaluated text-to-image DiT out, every artifact in between a versioned asset."""

__version__ = "0.1.0"
