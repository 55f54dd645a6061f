import sys

from utils.selfcheck.selfcheck import main

sys.exit(main())
