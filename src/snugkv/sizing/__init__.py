"""KV sizing: how many tokens the KV cache gets, decided after graphs are captured.

measure.py      the one place that reads free memory (MIN over ranks) and activation peaks
ledger.py       where the device's memory went, item by item
modes.py        the sizing modes: post-capture (default), profiled, static-fraction
post_capture.py tokens from measured free memory, commit with retry
"""
