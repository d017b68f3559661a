"""The one exception type a stage raises for bad input or an unmet precondition.

The CLI turns it into a one-line message on stderr and a non-zero exit code, so a
user never reads a traceback for a problem that is theirs to fix; ``exit_main`` does the same
for a module or bench script run on its own (``python -m andrea.curriculum.allocate``).
"""

import sys


class AndreaError(Exception):
    """A clear, user-facing error: the message names what is wrong (file, row, key)."""

    exit_code = 2


class ConfigError(AndreaError):
    """A merged config failed validation; the message names the key."""

    exit_code = 3


def exit_main(main, prog: str) -> None:
    """``sys.exit(main())``, an AndreaError as one line ``<prog>: error: ...`` and exit 2."""
    try:
        sys.exit(main())
    except AndreaError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
