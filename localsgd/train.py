"""`python -m localsgd.train [overrides]`: train (see `localsgd.cli.train`)."""

import logging
import os
import sys
import traceback


def main() -> None:
    # Workers run one thread each; set before numpy loads OpenBLAS, which would otherwise start
    # a thread pool here, in the process the workers' server is forked from.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from localsgd.cli import forkserver
    from localsgd.cli.train import cli

    forkserver.fork_from_here()  # before Hydra or a store starts a thread
    if not forkserver.under_torchrun():
        cli()
        return
    # A torchrun worker leaves as a spawned one does (`launch._spawned`): done and torn down,
    # without interpreter teardown, whose destruction of gloo's and torchft's native threads
    # has aborted a finished worker (SIGABRT, "terminate called without an active exception"),
    # which torchrun then reports as a failed job.
    try:
        cli()
        code = 0
    except SystemExit as e:
        code = exit_status(e.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    logging.shutdown()  # the run's log handlers, which interpreter exit would flush
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_status(code) -> int:
    """The status `sys.exit(code)` gives: None is 0, a number itself, anything else (a
    message, printed) 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    main()
