"""`python -m ha ...` runs the controller process (the `mqstore controller` verb calls ha.controller_server.main)."""

import sys

from ha.controller_server import main

sys.exit(main())
