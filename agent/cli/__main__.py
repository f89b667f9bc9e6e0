"""``python -m rankwatch.agent.cli``: the ``rankwatch`` command."""

import sys

from rankwatch.agent.cli.app import main

sys.exit(main())
