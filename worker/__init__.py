"""GPU/CPU workers: the engine (``engine``), models and their loaders (``models``), the
queue-facing service around them (``service``: stream intake, publishing) and load shedding
(``shedding``)."""
