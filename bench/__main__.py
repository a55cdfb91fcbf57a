"""`python -m agora.bench ...` is `agora-bench ...`."""

import sys

from agora.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
