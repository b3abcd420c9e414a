"""Commands: the tools a user types beside `dpt` (`dpt-predict`, `dpt-generate`, `dpt-tokenizer`,
`dpt-shards`). They read what a run left in its folder, or prepare data for one; none starts ranks
or trains, so nothing below imports them.

May import: dpt.loop, dpt.state, dpt.tasks, dpt.data, dpt.models, dpt.observe, base.
"""
