"""Small real stage modules for the orchestration tests (STAGERL_STAGES=_toy_stages): they keep
the stage contract (STAGE, INPUTS, CONFIG_KEYS, run(ctx) -> manifest), read their inputs from the
store and write schema-valid artifacts and weights through storage.*, seeded from ctx.seed, and
honour STAGERL_FAULT at start / after_rows / before_manifest. Fast: no model is run."""
import hashlib
import json
import time

from storage.faults import maybe_fault
from storage.artifacts import upload_files, write_manifest


def write(ctx, module, files, started, extra=None):
    maybe_fault(module.STAGE, "after_rows", ctx.step)
    entries = upload_files(ctx.store, ctx.layout, ctx.step, module.STAGE, files)
    return write_manifest(ctx.store, ctx.layout, ctx.step, module.STAGE, entries,
                          fingerprint=ctx.fingerprint(module.STAGE, module.CONFIG_KEYS, module.INPUTS),
                          inputs=ctx.input_fingerprints(module.INPUTS),
                          timings={"compute_s": round(time.perf_counter() - started, 4)},
                          extra=extra or {})


def digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
