"""Pipeline building blocks with no dependencies inside geopipe: the schedule IR (per-stage
action lists, their generators, text form and validator) and contiguous layer partitioning
with the Held–Karp site order."""
