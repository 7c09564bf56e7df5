"""The ground floor: records and helpers shared by every part of the pipeline (a call as data, batches,
rows along the sample axis, dtypes, notes, the tolerance policy, the machine, provenance, JSON views,
import paths). Nothing here imports from the parts above it.
"""
