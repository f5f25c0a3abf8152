"""Process entry point: `python -m consumers.scheduler ARGS` runs `rose scheduler ARGS` (the logic lives in rose/)."""

import sys

from rose.cli import main

if __name__ == "__main__":
    sys.argv[1:1] = ["scheduler"]
    main()
