"""A test plugin for rlvitals (tests/data/plugin_pkg): nothing here registers on import."""
