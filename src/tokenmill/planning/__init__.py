"""`tokenmill plan`: device counts for a model, a context length and a concurrency (`planner`), from a table
of known accelerators (`gpus`)."""
