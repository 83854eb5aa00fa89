"""fleetrl.regions (see DESIGN.md §2)."""
