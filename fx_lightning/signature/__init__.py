"""How the model is called, proven on its calls: :mod:`.sample_axis` (the experiment that proves a
sample axis, or refuses one), :mod:`.signature` (Signature, derive_signature), :mod:`.program` (the
one torch.export call, with the dimensions the signature says vary). Below the config schema:
formats, variants, export and serve read it.
"""
