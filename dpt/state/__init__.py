"""State: checkpoints (DCP, committed folders, rotation, resume), the parts they hold as
`Stateful`s, which config changes a resume may make, and what a run leaves for later use
(`data.json`, `model_best.pt`), and what earlier runs left in a run folder (`history`: its
curves are read through dpt.observe's event files).

May import: dpt.models, dpt.observe, base.
"""
