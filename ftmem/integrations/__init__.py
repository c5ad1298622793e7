"""Integrations with training frameworks: ``ftmem.integrations.transformers`` (the Hugging Face
Trainer, ``pip install 'ftmem[hf]'``) and ``ftmem.integrations.lightning`` (Lightning). Each imports its framework only when imported itself."""
