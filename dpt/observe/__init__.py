"""Observe: what a run shows of itself: per-rank and world metrics, TensorBoard event files and
dashboards, console and log lines, memory use, the roll call that names a silent rank.

May import: base.
"""
