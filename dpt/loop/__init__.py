"""Loop: the training loop (`trainer`) and the parts it orders, built once from the typed config
(`parts`): the task, strategy, precision, schedules, validation, early stopping, the agreement
between ranks, stop signals, and the rules a resumed run applies to them.

May import: dpt.monitor, dpt.state, dpt.tasks, dpt.data, dpt.models, dpt.observe, base.
"""
