"""`-m`: every job of a basic sweep checked before the first one starts.

Hydra's basic sweeper runs its jobs one after another and each job checks its own config when it
starts, so `-m sync.period=4,0` trained job 0 to the end before job 1 was refused. Here the
sweep is expanded as the basic sweeper expands it (`hydra.sweeper.params` and the command's
sweep overrides, `BasicSweeper.split_arguments`), and each job's config is composed and checked
in the launcher first. Another sweeper (Optuna) picks its values as it goes: its fixed
settings are checked once, each trial when it starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omegaconf import OmegaConf

from localsgd.config import ConfigError

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def sweep_jobs(args: list[str], compose: Callable) -> tuple[list[list[str]] | None, list[str], Any]:
    """The overrides of each job of the sweep `args` describes (None when the sweeper is not
    Hydra's basic one), the swept keys, and the config of the settings no sweep changes."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    try:
        overrides = parser.parse_overrides(args)
    except HydraException as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    fixed = [o.input_line for o in overrides if not o.is_sweep_override()]
    base = compose(fixed)
    if OmegaConf.select(base, "hydra.sweeper._target_") != BASIC_SWEEPER:
        return None, [], base
    params = OmegaConf.select(base, "hydra.sweeper.params") or {}
    lines = [f"{key}={value}" for key, value in params.items()] + args
    every = parser.parse_overrides(lines)
    swept = [o.key_or_group for o in every if o.is_sweep_override()]
    batches = BasicSweeper.split_arguments(every, None)
    return [job for batch in batches for job in batch], swept, base


def check_sweep(args: list[str], compose: Callable, check_job: Callable[[list[str]], None]) -> Any:
    """Check every job of the sweep (`check_job(job_overrides)`); a refusal names the job and
    its swept values. Returns the config of the settings no sweep changes."""
    jobs, swept, base = sweep_jobs(args, compose)
    if jobs is None:  # the sweeper chooses the values: check what is fixed
        from hydra.core.override_parser.overrides_parser import OverridesParser

        overrides = OverridesParser.create().parse_overrides(args)
        check_job([o.input_line for o in overrides if not o.is_sweep_override()])
        return base
    for number, job in enumerate(jobs):
        try:
            check_job(job)
        except ConfigError as e:
            values = [o for o in job if o.split("=", 1)[0].lstrip("+~") in swept]
            raise ConfigError(
                f"{e} (job {number} of the {len(jobs)}-job sweep: {' '.join(values)}; no job "
                f"was started)"
            ) from None
    return base
