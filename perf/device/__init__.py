"""``python -m perf.device PART``: the measurements on a GPU machine, each part one call of under 10 minutes
(perf/device/__main__.py lists them); the server's venv made from ``.gpu/`` (server_env.py)."""
