"""How the model is called, proven on its calls: :mod:`.sample_axis` (the experiment that proves a
sample axis, or refuses one), :mod:`.signature` (Signature, derive_signature), :mod:`.outputs` (the outputs'
containers: described, rebuilt, or refused), :mod:`.conditions` (torch.export's guards on sizes, checked on every
call), :mod:`.absent` (stand-ins for inputs left out or given once for every sample), :mod:`.padding` (sizes a
condition refuses, served padded where proven), :mod:`.program` (the one torch.export call, with the dimensions the
signature says vary). Below the config schema: formats, variants, export and serve read it.
"""
