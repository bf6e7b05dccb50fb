"""Periodic local SGD and post-local SGD for PyTorch."""

import os as _os


def _checkout_configs() -> None:
    """In a source checkout used without installing, make `conf/` beside this package the
    package `localsgd.conf`, which is what an install (pyproject.toml's package-dir) makes it;
    Hydra reads the configs from there by `pkg://localsgd.conf`."""
    import importlib.util
    import sys

    here = _os.path.dirname(_os.path.abspath(__file__))
    conf = _os.path.join(_os.path.dirname(here), "conf")
    init = _os.path.join(conf, "__init__.py")
    if _os.path.isdir(_os.path.join(here, "conf")) or not _os.path.isfile(init):
        return  # an installed wheel (localsgd/conf exists), or no checkout around it
    spec = importlib.util.spec_from_file_location(
        "localsgd.conf", init, submodule_search_locations=[conf]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["localsgd.conf"] = module
    spec.loader.exec_module(module)
    sys.modules[__name__].conf = module  # as an import would bind it


_checkout_configs()


def load(run_dir: str, best: bool = False, map_location="cpu"):
    """A finished run's model, built from its own config and loaded with its final weights
    (`best=True`: those `trainer.keep_best` kept): `localsgd.loading.load`."""
    from localsgd.loading import load as load_run

    return load_run(run_dir, best, map_location)
