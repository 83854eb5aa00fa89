"""fleetrl.hub (see DESIGN.md §2)."""
