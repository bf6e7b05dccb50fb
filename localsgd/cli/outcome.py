"""What the launcher shows at the end of a run, on the console and in the run's `train.log`.

The finished run's directory and summary (floats to 4 significant digits: the files keep every
digit), a language model's sample, the plot and the wandb upload command; or, for a stopped
run, its directory and the command that resumes it. Every line also goes to `train.log`, beside
the notices, so the log holds what the console showed (the progress bar's last state too:
`localsgd.loop.metrics.progress_bar`).
"""

from __future__ import annotations

import sys

from localsgd.loop.metrics import log_output

SUMMARY_KEYS = (
    "val_accuracy",
    "val_loss",
    "val_perplexity",
    "test_accuracy",
    "test_loss",
    "test_perplexity",
    "steps",
    "comm_rounds",
    "comm_bytes",
    "wall_time_s",
    "eval_seconds",
)


def show(text: str, err: bool = False) -> None:
    """`text` on stdout (stderr: `err`) and in the run's train.log."""
    print(text, file=sys.stderr if err else sys.stdout, flush=True)
    log_output(text)


def number(value) -> str:
    """A summary value as the console shows it: a float to 4 significant digits."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def summary_line(summary: dict) -> str:
    kept = [f"{k}={number(summary[k])}" for k in SUMMARY_KEYS if k in summary]
    return "summary: " + ", ".join(kept)
