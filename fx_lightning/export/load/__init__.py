"""Loading an export: :mod:`.loader` (load_fused, load_artifact) and :mod:`.interface` (an artifact
called as its signature says).
"""
