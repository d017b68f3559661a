"""The one exception type a stage raises for bad input or an unmet precondition.

The CLI turns it into a one-line message on stderr and a non-zero exit code, so a
user never reads a traceback for a problem that is theirs to fix; ``exit_main`` does the same
for a module or bench script run on its own (``python -m andrea.curriculum.allocate``), and for
a GPU bench run where CuPy or a GPU is missing.
"""

import sys


class AndreaError(Exception):
    """A clear, user-facing error: the message names what is wrong (file, row, key)."""

    exit_code = 2


class ConfigError(AndreaError):
    """A merged config failed validation; the message names the key."""

    exit_code = 3


def exit_main(main, prog: str, needs: tuple[str, ...] = ()) -> None:
    """``sys.exit(main())``, an AndreaError as one line ``<prog>: error: ...`` and exit 2. ``needs``: the
    libraries the script runs on (the GPU benches: cupy, torch); one of them missing, or CuPy finding no CUDA
    device or too old a driver, is one such line as well, naming it, instead of a traceback."""
    try:
        sys.exit(main())
    except AndreaError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except ModuleNotFoundError as e:
        root = (e.name or "").split(".")[0]
        if root not in needs:
            raise
        print(f"{prog}: error: needs {root}, which this Python cannot import ({e}); run it where {root} is "
              f"installed{' and a CUDA GPU is' if root == 'cupy' else ''}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:  # noqa: BLE001 - only CuPy's no-device refusals become one line; the rest re-raise
        if "cupy" not in needs or type(e).__name__ != "CUDARuntimeError" or not any(
                k in str(e) for k in NO_DEVICE):
            raise
        print(f"{prog}: error: CuPy finds no usable CUDA device ({e}); run it on a machine with an NVIDIA GPU",
              file=sys.stderr)
        sys.exit(2)


# the CUDA runtime errors that mean "no GPU here", as CuPy's CUDARuntimeError words them
NO_DEVICE = ("cudaErrorNoDevice", "cudaErrorInsufficientDriver")
