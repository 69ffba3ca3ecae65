"""The same maths, fast: calibrate (run: validate -> streams -> per block snapshot / solve / advance),
what one call carries (state: the frozen Run and Stack), step 1 (snapshot: one loop over a block's
task batches; blockstats: one block's statistics and systems; experts: the experts' side and the
ExpertTrace it reads and fills), what the run says (notes), the experts' cache between calls (trace),
the instant re-solve (preview), what a run did (report), where the blocks live while visited
(blocksource).

Imports method, model, util and config."""
