"""HTTP API v1: thin routes that parse, call a domain function, and shape the reply."""
