"""Live-traffic load tests of the OpenAI endpoint: a Locust file (``loadtest/locustfile.py``),
a sweep runner over server configurations and concurrency levels, and the Pareto-frontier
plots (paper Section 5.4, Figures 8 and 9). ``python -m dspark_serve.loadtest --help`` lists the commands.

Importing this package does not import Locust (which monkey-patches the standard library with
gevent); Locust only runs in its own subprocess."""
