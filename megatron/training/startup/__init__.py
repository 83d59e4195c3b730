"""What every rank does around training so a job fails early and in one line: preflight of the
output paths, the ranks' agreement, CPU binding, liveness, collective faults, SIGTERM."""
