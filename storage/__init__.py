"""Runs in object storage: a local folder by default, S3/MinIO via s3fs.

store      Store: one API (bytes, JSON, parquet, list, exists, delete, copy) over fsspec
layout     RunLayout: the only place that spells out keys (docs/architecture.md)
artifacts  atomic stage writes committed by a manifest; verified reads; fingerprint()
schemas    the pyarrow schema of every stage artifact
weights    HF folders to/from the store with a local cache keyed by checksum
lock       one writer per experiment
secrets    scrubbing of credentials from everything persisted
sinks      the metric sinks trainer.logger names (console, tensorboard, wandb): a registry
"""
