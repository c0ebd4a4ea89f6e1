"""Data: text to token shards, and shards to per-rank batches.

- ``data.tokenizer``: ``ByteTokenizer`` (no files) and ``HFTokenizer`` (a local tokenizer.json).
- ``data.prepare``: ``python -m data.prepare`` writes ``train-*.bin``, ``val-*.bin``, index.json;
  ``data.inputs`` reads its input formats, ``data.encode`` runs its tokenizing workers,
  ``data.writer`` writes the shards and swaps the finished directory into place.
- ``data.loader``: ``DataConfig``, ``open_sources`` and ``build_dataloader`` for the trainer.
- ``data.stream``: the global stream as index arithmetic: mixtures, epochs, the batch sampler.
- ``data.shuffle``: a seeded permutation of [0, n) computed per index (each epoch's order).
- ``data.documents``: document masking: document ids and targets derived from EOS per batch.
- ``data.sft``: fine-tuning examples (prompt/response, chat) rendered and tokenized with a
  loss mask, in ``data.prepare``'s workers.

Nothing is re-exported here, so ``python -m data.prepare`` does not pay for importing torch.
"""
