"""The planner: which sync settings suit a job and its link (`python -m localsgd.plan`).

`model` (the utilisation formula), `sizes` (what each setting sends), `grid` (the settings),
`evidence` (what the studies found about their loss), `measure` (the job's steps and the link,
timed here), `cli` (the command).
"""
