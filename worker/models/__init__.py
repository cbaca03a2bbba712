"""Model definitions (plain torch) the engine runs."""
