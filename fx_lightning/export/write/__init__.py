"""Writing an export: the formats, checked on the way, plus manifest.json, README.md, report.html and
the variants, atomically (:mod:`.writer`, :mod:`.atomic`, :mod:`.readme`, :mod:`.report_html`,
:mod:`.variants`; the raw-input prologue: :mod:`.input_contract`, :mod:`.prologue`,
:mod:`.raw_reference`).
"""
