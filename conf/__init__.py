# Makes `conf/` the package `localsgd.conf` (pyproject.toml maps it): Hydra's `pkg://` config
# source only accepts a folder holding an __init__.py.
