"""The formats layer: one home for each on-disk fact every stage shares.

- :mod:`.dtypes` — the dtype table (safetensors names, element sizes, user, torch and numpy names);
- :mod:`.safetensors` — safetensors header read (validated) and write;
- :mod:`.names` — HF file names (weights, index, shard pattern, config/tokenizer, PEFT adapter),
  the shard split and the index file;
- :mod:`.config` — the one config writer (``config.json`` & co. and the dtype it records).

Nothing here imports torch, numpy or transformers at import time; sources, the writer, verify and
the save-time hooks all read these facts from here rather than keeping a copy.
"""
