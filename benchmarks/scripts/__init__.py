"""Scripts run by hand (GPU check, AOT compile check, distributed scaling), kept apart
from the pytest-benchmark suites in benchmarks/. The reference training loop stays in
benchmarks/reference_gpt.py because the training benchmarks import it."""
