"""Streaming DiLoCo: the model averaged in fragments on a staggered schedule.

- `averager`: `StreamingAverager` (each fragment's outer step, its overlap τ and mixing α);
- `fragments`: how a model is cut into fragments.
"""
