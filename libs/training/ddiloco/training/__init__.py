"""ddiloco.training: what a learner trains and with what, as a library.

``model`` (the model registry: the built-in GPT, models by reference, ``transformers`` models),
``data`` (the offline corpora, token files and tokenizers, shards and batches), ``inner_loop``
(AdamW steps, evaluation), ``config`` (the ``train`` section), ``prepare_data`` (``ddiloco
prepare-data``) and ``export_io`` (loading a model ``ddiloco export`` wrote). Nothing here knows
about fragments, the network or the synchronizer.
"""
