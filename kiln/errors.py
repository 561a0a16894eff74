"""UserError: a mistake in what the user asked (an unknown name, a missing input, a cluster that does not
exist). `kiln` prints it as one line and exits 2; anything else is a bug and keeps its traceback.

Subclasses also derive from the builtin the code raised before (KeyError, FileNotFoundError), so callers
that catch those keep working.
"""

from __future__ import annotations


class UserError(Exception):
    def __str__(self) -> str:  # KeyError would quote its message
        return str(self.args[0]) if self.args else ""


class UnknownName(UserError, KeyError):
    """A stage, cluster or other named thing that does not exist."""


class MissingInput(UserError, FileNotFoundError):
    """An input folder or file that is not there, or holds nothing to read."""
