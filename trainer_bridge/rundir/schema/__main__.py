"""``python -m trainer_bridge.rundir.schema [docs/run-directory.md]``: print the tables, or rewrite them in place."""

import sys

from trainer_bridge.rundir.schema.docs import main

sys.exit(main())
