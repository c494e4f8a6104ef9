"""Benchmarks of ddiloco's hot paths; each prints a table and writes JSON (``ddiloco bench NAME``)."""
