"""``python -m ucm_server`` is ``ucm-server``."""

import sys

from ucm_server.cli import main

sys.exit(main())
