"""The paper's maths (read with docs/maths.md): per-task statistics (stats), the closed-form solves and
their residuals (solve), the CPU kernels behind them (linalg) and a run's choice of them, with its
buffers and factorisations (kernels), and the plain float64 path the engine is tested against
(reference).

Imports model, util and config."""
