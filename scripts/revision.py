"""A file of the repository as it stands at a git revision (the side-by-side scripts
compare this tree with an older one)."""

from __future__ import annotations

import subprocess


def source_at(revision: str, path: str) -> str:
    """The text of ``path`` (relative to the repository root) at ``revision``."""
    return subprocess.run(
        ["git", "show", f"{revision}:{path}"], capture_output=True, text=True, check=True
    ).stdout
