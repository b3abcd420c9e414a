"""Hydra plugin: `hydra/sweeper=optuna`, dpt's Optuna sweeper (see optuna_sweeper.py)."""
