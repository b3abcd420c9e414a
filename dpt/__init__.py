"""dpt: data-parallel training from one Hydra config.

The package is built in parts, each allowed to import only the parts below it (checked by
tests/test_layout.py, which reads the "May import:" line of each part's `__init__.py`):

    launch    the commands (dpt, dpt-predict), Hydra's run, config checks, how ranks start
    loop      the training loop and the parts it orders: strategy, precision, validation
    state     checkpoints, resume rules, what a run leaves (data.json, model_best.pt)
    data, models, observe
              data sets and loaders; model builders; metrics, logs, TensorBoard
    base      the modules beside this file: config schemas, errors, the own-code contract,
              the process group, seeds; they import only each other
"""
