"""Load: the work (``workload.py``: prompts, lengths, arrival schedules), the clients that submit
and follow it (``http.py``, ``follow.py``, ``patient_client.py``) and check every stream they
read (``stream_check.py``), and the generator running them in several processes
(``loadgen.py``)."""
