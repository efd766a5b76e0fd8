"""OpenAI-compatible HTTP server over the embedded engine: ``app.create_app(engine)``."""
