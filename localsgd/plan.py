"""`python -m localsgd.plan [options] [overrides]`: sync settings for this job and link.

See `localsgd.planner` (and `localsgd.planner.cli` for the options)."""

import os
import sys


def main() -> None:
    # one thread a worker, set before numpy loads OpenBLAS (as `localsgd.train` does)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from localsgd.cli import forkserver
    from localsgd.planner.cli import main as plan

    forkserver.fork_from_here()  # before Hydra or a store starts a thread
    sys.exit(plan())


if __name__ == "__main__":
    main()
