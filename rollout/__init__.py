"""fleetrl.rollout (see DESIGN.md §2)."""
