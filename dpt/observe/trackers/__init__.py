"""Trackers: observers of the world's metric stream that TensorBoard's world folder gets, on rank 0.

Each tracker (`logger=[...]`: MLflow, W&B, CSV) answers four calls (`tracker.Tracker`): start
(the config as parameters, dpt's tags, the run to continue), metrics at a step, files at the
end, finish. They run in a process of their own (`process`), to which rank 0's `Trackers`
(`handoff`) sends the world's rows in batches, so that the loop never waits for a server nor
shares its interpreter with a client; a call that fails is tried again, then that tracker is
dropped with one warning (`fanout`), and the run goes on: its own files (metrics.json, tb/) are
complete whatever a tracker did.
"""

from dpt.observe.trackers.handoff import Trackers

__all__ = ["Trackers"]
