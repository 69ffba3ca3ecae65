"""The Calibrate page's measured gains per calibration size come from the file the benchmark writes."""

import json

from app import settings


def test_the_gains_per_size_are_read_from_the_benchmarks_file(tmp_path):
    shipped = json.loads(settings.MEASURED_SIZES.read_text())
    assert settings.DEMO_N_GAINS == {int(n): (r["gain_pp"], r["exact_cpu_s"]) for n, r in shipped.items()}
    assert settings.DEFAULT_N in settings.DEMO_N_GAINS
    f = tmp_path / "sizes.json"
    f.write_text(json.dumps({"8": {"gain_pp": 1.5, "exact_cpu_s": 0.2}, "4": {"gain_pp": 0.5, "exact_cpu_s": 0.1}}))
    assert settings.demo_n_gains(f) == {8: (1.5, 0.2), 4: (0.5, 0.1)}
    assert settings.demo_n_gains(tmp_path / "missing.json") == {}
