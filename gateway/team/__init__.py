"""A team on one fleet: named keys (keys.py), their limits and usage (limits.py: the values;
windows.py: local sliding windows; state.py: the counters, local or shared through Redis),
priority classes and fallbacks between presets (fallback.py)."""
