import sys

from utils.planner.plan import main

sys.exit(main())
