"""What the engine serves without a hub: the default target model (fetched and converted once)
and the drafters, STS and lookup calibrations shipped for it (``drafters/``)."""
