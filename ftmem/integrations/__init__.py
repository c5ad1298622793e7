"""Integrations with training frameworks: ``ftmem.integrations.transformers`` (the Hugging Face
Trainer, ``pip install 'ftmem[hf]'``), ``ftmem.integrations.lightning`` (Lightning) and
``ftmem.integrations.torchtitan`` (torchtitan's checkpoint manager, ``pip install
'ftmem[torchtitan]'``). Each imports its framework only when imported itself."""
