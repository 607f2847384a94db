"""Configuration: the command line's flags by area, their checks and derived values."""
