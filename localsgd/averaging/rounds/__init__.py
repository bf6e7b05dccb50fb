"""The sync round as a pipeline of stages (see `pipeline` for the drawing): what a worker
offers (`contribution`), how it goes out (`wire`), the collective and how the contributions
combine (`combine`), the outer step (`outer`) and how the values take the result (`merge`), over
one part of the flat buffers (`part`). Every averager runs its rounds through `Rounds`."""

from localsgd.averaging.rounds.outer import DILOCO, OUTER_DEFAULTS, outer_step
from localsgd.averaging.rounds.part import Part, Slice, whole
from localsgd.averaging.rounds.pipeline import Rounds

__all__ = ["DILOCO", "OUTER_DEFAULTS", "Part", "Rounds", "Slice", "outer_step", "whole"]
