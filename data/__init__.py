"""Data: text to token shards, and shards to per-rank batches.

- ``data.tokenizer``: ``ByteTokenizer`` (no files) and ``HFTokenizer`` (a local tokenizer.json).
- ``data.prepare``: ``python -m data.prepare`` writes ``train-*.bin``, ``val-*.bin``, index.json;
  ``data.inputs`` reads its input formats, ``data.encode`` runs its tokenizing workers,
  ``data.writer`` writes the shards and swaps the finished directory into place.
- ``data.loader``: ``DataConfig``, ``open_dataset`` and ``build_dataloader`` for the trainer.

Nothing is re-exported here, so ``python -m data.prepare`` does not pay for importing torch.
"""
