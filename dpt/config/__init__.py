"""dpt's config, typed: a schema for every config group's options, checked while Hydra composes.

- `store`: the whole config (`Config`), every group's options (`SCHEMAS`), the ConfigStore.
- `trainer`, `monitor`: the keys with no YAML of their own (`trainer`, `checkpoint`, `sweep`,
  `monitor`), whose defaults are in their schemas.
- `models`, `datasets`, `tasks`, `strategies`, `launchers`, `optim`: each group's options; an
  option's values live in its YAML file (`dpt/conf/<group>/<option>.yaml`), its schema gives
  the types (`???` until the YAML fills them), the values a key may take beyond its type
  (`checks`), and the facts the rest of dpt asks without torch (a task's kind and metrics, a
  strategy's processes).
- `build`: a node turned into its object, its failures in one line.

Every allowed value is defined once, beside its key, and imported by whoever checks, builds,
documents or prints it. Ranges a field's check cannot say (keys that relate to each other) are
checked by `dpt.launch.validate` before Hydra makes the run folder.
"""
