"""Tables and plots from finished runs and run tables: `python -m localsgd.report`."""
