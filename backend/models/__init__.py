"""Model families the engine can serve."""
