"""The `pagefleet` command line."""
