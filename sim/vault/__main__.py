import sys

from sim.vault.server import main

sys.exit(main())
