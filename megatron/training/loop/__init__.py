"""The training loop both step kinds share (`run`), its per-iteration services, its batches,
its log line and its end-of-run memory report."""
