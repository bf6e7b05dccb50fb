"""Imported by the workers' server alone, as the last module it preloads
(`localsgd.cli.forkserver.PRELOAD`): the public server is a fresh interpreter that runs nothing of
ours but these imports. Importing it anywhere else would make that process ignore SIGTERM."""

from localsgd.cli.forkserver import become_server

become_server()
