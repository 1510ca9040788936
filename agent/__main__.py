"""``python -m agent`` is ``gpu-agent``."""

import sys

from agent.cli.main import main

sys.exit(main())
