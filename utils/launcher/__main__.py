import sys

from utils.launcher.launch import main

sys.exit(main(sys.argv[1:]))
