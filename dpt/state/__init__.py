"""State: checkpoints (DCP, committed folders, rotation, resume), the parts they hold as
`Stateful`s, which config changes a resume may make, and what a run leaves for later use
(`data.json`, `model_best.pt`).

May import: dpt.models, base.
"""
