"""`python -m furlong ...` (and `torchrun -m furlong train ...` for multi-node runs)."""
import sys

from furlong.cli import main

sys.exit(main())
