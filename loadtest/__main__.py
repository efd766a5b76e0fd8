import sys

from dspark_serve.loadtest.cli import main

sys.exit(main())
