"""The `weightsync` command that ships inside the package."""

from __future__ import annotations

import os

from ._errors import Error


def cli_path() -> str:
    """The path of the `weightsync` command (demo, bench, plan, shard,
    materialize, ...) that this package was built with."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "weightsync")
    if os.access(here, os.X_OK):
        return here
    found = os.environ.get("WEIGHTSYNC_CLI")
    if found:
        return found
    raise Error("not_found", f"the weightsync command is not installed beside the package ({here}); "
                "set WEIGHTSYNC_CLI to its path")
