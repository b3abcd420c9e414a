"""Launch: the command that trains (`dpt`, `python train.py`), Hydra's run and
its callbacks, the config checks made before anything starts, and how ranks start (in this
process, an elastic local world from a fork server, torchrun, SLURM) and run (`worker`); the
config reference that `dpt --help` is the short form of (`reference`).

May import: dpt.loop, dpt.monitor, dpt.state, dpt.tasks, dpt.data, dpt.models, dpt.observe,
base.
"""
