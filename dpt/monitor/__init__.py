"""Monitor: training that watches itself: detectors that flag a loss or gradient spike, a
non-finite value and a slowdown against robust running levels, judged on what the ranks'
agreement gathered (`monitor`), their events (`events`: events.jsonl, console lines), the replay
that names the first module whose output is not finite, and gradient diagnostics. The loop wires
them in and takes the reactions (dpt.loop.reactions).

May import: dpt.models, dpt.observe, base.
"""
