import sys

from profiler.cli import main

sys.exit(main())
