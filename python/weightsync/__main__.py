"""`python -m weightsync ...` (and the `weightsync` console script): runs the
`weightsync` command shipped inside the package with the same arguments."""

import os
import sys

from ._cli import cli_path


def main() -> None:
    path = cli_path()
    os.execv(path, [path] + sys.argv[1:])


if __name__ == "__main__":
    main()
