"""Scripts run by hand (GPU check, AOT compile check, distributed scaling, the reference loop),
kept apart from the pytest-benchmark suites in benchmarks/."""
