"""`python -m furlong ...` (and `torchrun -m furlong train ...` for multi-node runs).

A torchrun worker ends without interpreter teardown once its output is flushed, as the workers
furlong spawns itself do (launch/distributed.py): teardown runs C++ static destructors, and a
still-joinable library thread there aborts the process now and then ("terminate called without an
active exception", exit -6) long after the work succeeded. A 2-node CPU run under torchrun ended so:
rank 1 hung after its last rollout until torchrun's exit barrier gave up (300 s), then aborted
(teardown is the likely place; not confirmed). Files are closed by then (no furlong code relies on
atexit).
"""
import os
import sys

from furlong.cli import main

code = main()
if "TORCHELASTIC_RESTART_COUNT" in os.environ:   # set by torchrun's agent for its workers
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
