"""Model definitions (plain torch) the engine runs, and their loaders (``loaders``)."""
