"""fleetrl.trainer (see DESIGN.md §2)."""
