import sys

from utils.runtime.engine.rank_console import route_console

route_console()          # one console: known-harmless third-party warnings off it (before transformers loads)

from utils.planner.plan import main  # noqa: E402

sys.exit(main())
