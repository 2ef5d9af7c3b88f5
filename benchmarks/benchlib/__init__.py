"""Shared pieces of the serving benchmarks: the random chat model, the launcher, the streaming
client, metric scraping and the machine note. Imported by the scripts in ``benchmarks/`` (their
folder is on ``sys.path`` when run as ``python benchmarks/NAME.py``)."""
