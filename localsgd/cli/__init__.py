"""The command line: `python -m localsgd.train`, launching workers, and every check of the
user's input (overrides, config values, data and model shapes, resume) before a worker starts."""
