"""Selecting what to serve: :mod:`.sweep` (the throughput sweep), :mod:`.timing` (interleaved and
own-process timing), :mod:`.selection` (bench, check, record the fastest).
"""
