"""Trust: rounds over gathered contributions from workers that may not deserve it.

- `robust`: the combine rules (`RULES`: mean, clip, trimmed mean, median, sign);
- `judge`: scoring a contribution by the loss it gives on a held-out batch;
- `held_out`: every worker's losses on the round's held-out batch;
- `leave_one_out`: a contribution held against the round's aggregate with and without it;
- `trusted_round`: one round: drop what is not finite, score, exclude, aggregate.
"""
