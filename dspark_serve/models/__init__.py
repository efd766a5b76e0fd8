"""Target models the engine can serve without a hub: the default model recipe."""
