"""The same maths, fast: calibrate (run: validate -> streams -> per block snapshot / solve / advance),
one block's statistics and systems (blockstats), the experts' cache between calls (trace), the instant
re-solve (preview), what a run did (report), where the blocks live while visited (blocksource).

Imports method, model, util and config."""
