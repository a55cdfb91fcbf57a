"""`python -m agora.node ...` is `agora-node ...`."""

import sys

from agora.node.cli import main

sys.exit(main())
