"""Process entry point: `python -m producers.agent ARGS` runs `rose agent ARGS` (the logic lives in rose/)."""

import sys

from rose.cli import main

if __name__ == "__main__":
    sys.argv[1:1] = ["agent"]
    main()
