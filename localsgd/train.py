"""`python -m localsgd.train [overrides]`: train (see `localsgd.cli.train`)."""

import os


def main() -> None:
    # Workers run one thread each; set before numpy loads OpenBLAS, which would otherwise start
    # a thread pool here, in the process the workers' server is forked from.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from localsgd.cli import forkserver
    from localsgd.cli.train import cli

    forkserver.fork_from_here()  # before Hydra or a store starts a thread
    cli()


if __name__ == "__main__":
    main()
