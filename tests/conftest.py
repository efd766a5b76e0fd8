"""Suite-wide settings, applied before any test module imports torch."""
import os

# Tests run live servers beside the test process on a 2-core machine; OpenMP's default
# spin-waiting barriers make every multi-threaded step 5-30x slower when cores are shared.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
