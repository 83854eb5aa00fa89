"""fleetrl.broker (see DESIGN.md §2)."""
