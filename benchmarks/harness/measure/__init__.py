"""What the load saw, turned into checks and numbers: structured outputs checked against their
schemas (``json_check.py``), latency and goodput (``metrics.py``), the generator's own ceiling
(``capacity.py``), the printed and plotted report (``report.py``), the record a result
carries (``record.py``: the command, the machine, the commit) and device timing
(``cuda_timing.py``)."""
