"""dpt's config groups, shipped inside the package so that an installed dpt finds them.

Hydra reads them as `pkg://dpt.conf` (dpt/launch/cli.py): from a clone, an editable install or
a wheel.
"""
