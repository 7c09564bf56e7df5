"""Capture: a module (and the configured trace) -> a GraphModule the passes can work on.

:mod:`.graph` (capture, eval_copy), :mod:`.faithful` (a capture checked against the eager module),
:mod:`.fuse_report` (FuseReport: what fuse() did).
"""
