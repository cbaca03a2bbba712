"""GPU/CPU workers: stream intake, the engine, models and loaders, token publishing."""
