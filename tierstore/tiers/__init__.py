"""The tiers: disk (source of truth), host RAM cache, device window."""
