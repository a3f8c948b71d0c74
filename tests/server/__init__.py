"""Tests that start the real server (gunicorn through bin/serve, harness/servers.py): load, faults, swaps, the V2
protocol with tritonclient, the client, every documented command, the browser, a new user's first run."""
