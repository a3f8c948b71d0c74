"""How the service is hosted: gunicorn's worker, start-up, drain, the host's facts, process statistics and the
control directory's names. No torch, no Flask (the gunicorn master imports it)."""
