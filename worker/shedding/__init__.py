"""Load shedding: the deadline-aware admission of jobs (``load_shedder``) and the engine
timings it learns from (``calibration``).
"""
