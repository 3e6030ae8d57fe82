import sys


def run() -> int:
    """The command line (``python -m veloxquant_mlx``, the ``veloxquant-mlx`` script)."""
    try:
        from .cli import main
    except KeyboardInterrupt:  # Ctrl-C while the subcommands import: one line, as during a command
        print("interrupted", file=sys.stderr)
        return 130
    return main()


if __name__ == "__main__":
    sys.exit(run())
