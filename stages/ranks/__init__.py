"""Running a stage on N ranks: per-call launches, the persistent rank pool and its servers, the
fork server (zygote) ranks and workers start from, files ranks ship back, DeepSpeed's prebuilt op.
"""
