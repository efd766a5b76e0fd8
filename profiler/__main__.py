import sys

from dspark_serve.profiler.cli import main

sys.exit(main())
