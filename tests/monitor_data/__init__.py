"""A user's own data set and model, as dpt.contract documents them, that misbehave on purpose: the
monitor's tests inject spikes and non-finite values through them (`--config-dir
tests/monitor_data/conf dataset=poisoned`)."""
