"""Trackers: observers of the world's metric stream that TensorBoard's world folder gets, on rank 0.

Each tracker (`logger=[...]`: MLflow, W&B, CSV) answers four calls (`tracker.Tracker`): start
(the config as parameters, dpt's tags, the run to continue), metrics at a step, files at the
end, finish. `Trackers` hands them to one thread of their own, so that the loop never waits for
a server; a call that fails is tried again, then that tracker is dropped with one warning, and
the run goes on: its own files (metrics.json, tb/) are complete whatever a tracker did.
"""

from dpt.observe.trackers.fanout import Trackers

__all__ = ["Trackers"]
