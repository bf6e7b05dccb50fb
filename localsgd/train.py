"""`python -m localsgd.train [overrides]`: train (see `localsgd.cli.train`)."""

from localsgd.cli import forkserver


def main() -> None:
    forkserver.warm_up()  # first: the server imports torch while this process does
    from localsgd.cli.train import cli

    cli()


if __name__ == "__main__":
    main()
