"""`python -m localsgd.train [overrides]`: train (see `localsgd.cli.train`)."""

from localsgd.cli.train import cli

if __name__ == "__main__":
    cli()
