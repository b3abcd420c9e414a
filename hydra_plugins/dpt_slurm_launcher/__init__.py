"""Hydra plugin: the SLURM launcher that `launcher=slurm` selects (see dpt_slurm_launcher.py)."""
