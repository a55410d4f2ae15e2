"""`python -m cachesvc.bench.gpu_check --out DIR` (`make gpu-check`): the check is `run.py`."""

import sys

from cachesvc.bench.gpu_check.run import main

if __name__ == "__main__":
    sys.exit(main())
