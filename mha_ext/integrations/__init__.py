"""Integrations of mha_ext with other libraries (each imported on demand)."""
