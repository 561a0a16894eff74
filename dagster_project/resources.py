"""The one resource every kiln asset uses: the composed config and where artifacts live."""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from kiln.config import KilnConfig, load_config


class KilnResource(dg.ConfigurableResource):
    """Hydra overrides (as on the command line) and the artifact root, settable from the launchpad."""

    overrides: list[str] = []
    data_dir: str = "data"

    def config(self, extra: list[str] | None = None) -> KilnConfig:
        """The composed config; `extra` overrides come after the resource's (a step's own inputs)."""
        return load_config([*self.overrides, *(extra or [])])

    def config_of(self, node) -> KilnConfig:
        """The config a node of the registry composes: these overrides, shaped by its rung (kiln.registry)."""
        return load_config(node.overrides(list(self.overrides), self.data_dir))

    def path(self, name: str) -> Path:
        return Path(self.data_dir) / name
