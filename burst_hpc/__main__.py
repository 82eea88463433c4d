"""python -m burst_hpc: the burst-hpc command."""
import sys

from .cli import main

sys.exit(main())
