"""The one exception type a stage raises for bad input or an unmet precondition.

The CLI turns it into a one-line message on stderr and a non-zero exit code, so a
user never reads a traceback for a problem that is theirs to fix.
"""


class AndreaError(Exception):
    """A clear, user-facing error: the message names what is wrong (file, row, key)."""

    exit_code = 2


class ConfigError(AndreaError):
    """A merged config failed validation; the message names the key."""

    exit_code = 3
