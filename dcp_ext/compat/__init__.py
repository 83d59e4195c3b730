"""Compatibility shims: megatron-core on CPU ranks (cpu_compat) and the megatron-core
version this fork pins (mcore_compat). Installed once, at the entry point."""
