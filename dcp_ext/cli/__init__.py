"""Command-line tools: dcp-plan, dcp-simulate (pure) and dcp-profile (torch harness)."""
