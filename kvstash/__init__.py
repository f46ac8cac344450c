"""The `kvstash` command line: one entry point over every part."""
