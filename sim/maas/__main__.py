import sys

from sim.maas.cli import main

sys.exit(main())
