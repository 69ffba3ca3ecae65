"""Merges bigger than memory: calibrate_checkpoints streams every model block by block from its
checkpoint shards through the engine and writes the result shard by shard.

Imports the engine, baselines and below."""
