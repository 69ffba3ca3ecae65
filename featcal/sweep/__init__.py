"""Around the method: sweeps over (lam, rho, alpha) and automatic selection (search, jobs), the paper's
studies (studies, corrupt), and their figures. Imports baselines, streaming, the engine and below."""
