"""Files shipped inside an ``andrea export`` folder for ``transformers`` (see andrea/export.py).

``tokenization_andrea.py`` is copied verbatim into the export and loaded there with
``AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)``; ANDREA never imports it.
"""
