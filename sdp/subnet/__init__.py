"""Subnetwork Data Parallelism: coverage planner, masking and owner-set gradient sync."""
